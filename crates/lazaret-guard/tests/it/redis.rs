//! Redis Streams against a real Redis (`LAZARET_TEST_REDIS_URL`, e.g.
//! `redis://127.0.0.1:6379`): the shared scenarios, through the
//! [`TestBroker`] below, and what only the Redis adapter has: how an
//! entry's fields map, the claim of an entry a dead consumer left pending,
//! renewing a running entry without counting a delivery, a hand-back that
//! charges nothing, the dead-stream format, `XADD` of binary headers.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ::redis::aio::MultiplexedConnection;
use ::redis::{Client, Value as RValue};
use lazaret_core::{DeadLetterReason, Failure, FailureClass};
use lazaret_guard::{
    Broker, BrokerKind, Consumer, Faults, Handler, Host, Incoming, Mode, Outcome, OwnedCall,
    Republish, SourceSet, SourceSpec, handler_fn,
};
use lazaret_store::{Stage, Store};
use serde_json::{Map, Value, json};

use crate::common::{self, Log, Seen, TestBroker};

/// The job type of every source here.
const TYPE: &str = "orders";

/// Redis for the shared scenarios and the tests below.
pub struct Redis {
    url: String,
    client: Client,
}

impl Redis {
    /// `None` (the test is skipped) without `LAZARET_TEST_REDIS_URL`.
    pub fn new() -> Option<Redis> {
        let url = common::service("LAZARET_TEST_REDIS_URL")?;
        let client = Client::open(url.as_str()).expect("a valid LAZARET_TEST_REDIS_URL");
        Some(Redis { url, client })
    }

    async fn conn(&self) -> MultiplexedConnection {
        self.client
            .get_multiplexed_async_connection()
            .await
            .expect("connect to redis")
    }

    /// Runs one command and returns its raw reply.
    async fn run(&self, args: &[&[u8]]) -> RValue {
        let mut cmd = ::redis::cmd(std::str::from_utf8(args[0]).expect("a command name"));
        for a in &args[1..] {
            cmd.arg(*a);
        }
        cmd.query_async::<RValue>(&mut self.conn().await)
            .await
            .unwrap_or_else(|e| panic!("{:?}: {e}", String::from_utf8_lossy(args[0])))
    }

    /// `XADD <stream> * <fields…>`; the new entry's id.
    async fn xadd(&self, stream: &str, fields: &[(&str, &[u8])]) -> String {
        let mut args: Vec<&[u8]> = vec![b"XADD", stream.as_bytes(), b"*"];
        for (k, v) in fields {
            args.push(k.as_bytes());
            args.push(v);
        }
        text(&self.run(&args).await)
    }

    /// How many entries the group has pending.
    async fn pending(&self, stream: &str, group: &str) -> i64 {
        match self
            .run(&[b"XPENDING", stream.as_bytes(), group.as_bytes()])
            .await
        {
            RValue::Array(parts) => match parts.first() {
                Some(RValue::Int(n)) => *n,
                other => panic!("XPENDING summary: {other:?}"),
            },
            other => panic!("XPENDING summary: {other:?}"),
        }
    }

    /// (consumer, idle ms, delivery count) of one pending entry.
    async fn pending_entry(&self, stream: &str, id: &str) -> Option<(String, i64, i64)> {
        let reply = self
            .run(&[
                b"XPENDING",
                stream.as_bytes(),
                b"lazaret",
                id.as_bytes(),
                id.as_bytes(),
                b"1",
            ])
            .await;
        let RValue::Array(rows) = reply else {
            panic!("XPENDING: {reply:?}")
        };
        let RValue::Array(row) = rows.first()? else {
            panic!("XPENDING row: {rows:?}")
        };
        match (&row[1], &row[2], &row[3]) {
            (c, RValue::Int(idle), RValue::Int(count)) => Some((text(c), *idle, *count)),
            _ => panic!("XPENDING row: {row:?}"),
        }
    }

    /// Waits until nothing is pending in the group.
    async fn wait_settled(&self, stream: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let n = self.pending(stream, "lazaret").await;
            if n == 0 {
                return;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{n} entries of {stream} still pending after 10 s"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn spec_with(&self, name: &str, queue: &str, mode: Mode, timeout: Duration) -> SourceSpec {
        let mut spec = self.spec(name, queue, mode);
        spec.delivery_timeout = timeout;
        spec
    }
}

/// The Redis of `LAZARET_TEST_REDIS_URL`, or `None` (the test is skipped):
/// what `scenario_suite!` needs.
pub async fn redis_or_skip() -> Option<Redis> {
    Redis::new()
}

fn text(v: &RValue) -> String {
    match v {
        RValue::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        RValue::SimpleString(s) => s.clone(),
        other => panic!("expected text, got {other:?}"),
    }
}

/// The fields of `[id, [field, value, …]]`.
fn entry_fields(entry: &RValue) -> (String, Vec<(String, Vec<u8>)>) {
    let RValue::Array(pair) = entry else {
        panic!("an entry: {entry:?}")
    };
    let RValue::Array(flat) = &pair[1] else {
        panic!("entry fields: {pair:?}")
    };
    let fields = flat
        .chunks(2)
        .map(|kv| match (&kv[0], &kv[1]) {
            (k, RValue::BulkString(v)) => (text(k), v.clone()),
            other => panic!("a field: {other:?}"),
        })
        .collect();
    (text(&pair[0]), fields)
}

impl TestBroker for Redis {
    async fn fresh_queue(&self, prefix: &str) -> String {
        // The adapter creates the stream and its group (`MKSTREAM`, from
        // `0`), so entries produced before the guard starts are consumed.
        common::unique(prefix)
    }

    fn spec(&self, name: &str, queue: &str, mode: Mode) -> SourceSpec {
        let mut spec = match mode {
            Mode::Guard => SourceSpec::guard(name, BrokerKind::Redis, &self.url, queue, TYPE),
            Mode::Watch => SourceSpec::watch(name, BrokerKind::Redis, &self.url, queue, TYPE),
        };
        spec.concurrency = 4;
        // The handlers here answer at once; a short timeout keeps the claim
        // of an entry a crashed guard left pending (after twice this) quick.
        spec.delivery_timeout = Duration::from_secs(1);
        spec
    }

    async fn produce(
        &self,
        queue: &str,
        message_id: &str,
        body: &[u8],
        headers: Map<String, Value>,
    ) {
        let values: Vec<(String, Vec<u8>)> = headers
            .iter()
            .map(|(k, v)| (k.clone(), lazaret_guard::message::value_bytes(v)))
            .collect();
        let mut fields: Vec<(&str, &[u8])> =
            vec![("body", body), ("message_id", message_id.as_bytes())];
        fields.extend(values.iter().map(|(k, v)| (k.as_str(), v.as_slice())));
        self.xadd(queue, &fields).await;
    }

    async fn broker_dead_letter(
        &self,
        prefix: &str,
        message_id: &str,
        body: &[u8],
    ) -> (String, String) {
        // Redis dead-letters nothing itself: the application copies the
        // entry it gave up on to its dead stream, in the adapter's format.
        // The original entry is gone from its (trimmed) stream, so a
        // redrive's entry is the first one there.
        let original = common::unique(prefix);
        let dead = common::unique(&format!("{prefix}-dead"));
        let now_ms = lazaret_guard::guard::now().as_millis();
        let original_id = format!("{}-0", now_ms - 60_000);
        let failed_at = now_ms.to_string();
        self.xadd(
            &dead,
            &[
                ("body", body),
                ("message_id", message_id.as_bytes()),
                ("reason", b"max_deliveries"),
                (
                    "error",
                    b"gave up after 5 deliveries: payment service refused",
                ),
                ("original_stream", original.as_bytes()),
                ("original_id", original_id.as_bytes()),
                ("delivery_count", b"5"),
                ("failed_at", failed_at.as_bytes()),
                ("tenant", b"acme"),
            ],
        )
        .await;
        (dead, original)
    }

    fn broker_reason(&self) -> DeadLetterReason {
        DeadLetterReason::MaxDeliveries
    }

    async fn take_one(&self, queue: &str, wait: Duration) -> Option<(Vec<u8>, Map<String, Value>)> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let reply = self
                .run(&[b"XRANGE", queue.as_bytes(), b"-", b"+", b"COUNT", b"1"])
                .await;
            if let RValue::Array(entries) = &reply {
                if let Some(entry) = entries.first() {
                    let (id, fields) = entry_fields(entry);
                    // Taken: the next call sees the next entry.
                    self.run(&[b"XDEL", queue.as_bytes(), id.as_bytes()]).await;
                    let mut body = Vec::new();
                    let mut headers = Map::new();
                    for (k, v) in fields {
                        if k == "body" {
                            body = v;
                        } else {
                            headers.insert(k, lazaret_guard::message::bytes_value(&v));
                        }
                    }
                    return Some((body, headers));
                }
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// A handler that keeps every call whole (headers included) and answers
/// with `answer`.
fn keeping(log: &Log, calls: &Arc<Mutex<Vec<OwnedCall>>>, answer: Outcome) -> Arc<dyn Handler> {
    let log = log.clone();
    let calls = Arc::clone(calls);
    Arc::new(handler_fn(move |call: OwnedCall| {
        log.push(Seen {
            message_id: call.delivery.message_id.clone(),
            attempt: call.attempt,
            body: call.delivery.body.clone(),
        });
        calls.lock().unwrap().push(call);
        let answer = answer.clone();
        async move { answer }
    }))
}

/// The consumer's next entry, within 10 s.
async fn next(c: &mut Box<dyn Consumer>) -> Incoming {
    tokio::time::timeout(Duration::from_secs(10), c.next())
        .await
        .expect("an entry within 10 s")
        .expect("read")
        .expect("the consumer stays open")
}

async fn broker(spec: &SourceSpec) -> Arc<dyn Broker> {
    lazaret_guard::connect(spec)
        .await
        .expect("connect to redis")
        .into()
}

#[tokio::test]
async fn a_guard_delivers_entries_with_their_ids_and_headers() {
    let Some(r) = Redis::new() else { return };
    let dir = tempfile::tempdir().expect("a temporary directory");
    let q = r.fresh_queue("redis-deliver").await;
    r.produce(
        &q,
        "m-1",
        b"one",
        common::headers(json!({"tenant": "acme"})),
    )
    .await;
    let bare = r
        .xadd(
            &q,
            &[
                ("payload", b"two"),
                ("content-type", b"text/plain"),
                ("bin", &[0xff, 0]),
            ],
        )
        .await;

    let log = Log::default();
    let calls = Arc::new(Mutex::new(Vec::new()));
    let host = common::host(
        dir.path(),
        common::policies(TYPE, 3, Duration::from_millis(100)),
    );
    let spec = r.spec("redis-deliver", &q, Mode::Guard);
    let running = common::start_guard(
        &r,
        spec,
        host,
        keeping(&log, &calls, Outcome::Success),
        Faults::default(),
    )
    .await;

    let seen = log
        .wait_for(Duration::from_secs(10), |s| s.len() >= 2)
        .await;
    r.wait_settled(&q).await;
    running.stop().await.expect("the guard stops cleanly");

    assert_eq!(common::counts(&seen).len(), 2, "each entry once: {seen:#?}");
    assert!(seen.iter().all(|s| s.attempt == 1), "{seen:#?}");
    let calls = calls.lock().unwrap().clone();
    let first = calls
        .iter()
        .find(|c| c.delivery.message_id == "m-1")
        .expect("m-1 delivered");
    assert_eq!(first.delivery.body, b"one");
    assert_eq!(
        Value::Object(first.delivery.headers.clone()),
        json!({"tenant": "acme"})
    );
    assert_eq!(first.delivery.queue, q);
    assert_eq!(first.idempotency_key, "redis-deliver:m-1");
    let second = calls
        .iter()
        .find(|c| c.delivery.message_id == bare)
        .expect("the entry without message_id delivered under its entry id");
    assert_eq!(second.delivery.body, b"two");
    assert_eq!(second.delivery.content_type.as_deref(), Some("text/plain"));
    assert_eq!(
        Value::Object(second.delivery.headers.clone()),
        json!({"bin": {"base64": "/wA="}})
    );
    assert_eq!(second.delivery.position, json!({"entry_id": bare}));
}

#[tokio::test]
async fn an_entry_abandoned_by_a_dead_consumer_is_claimed_with_attempt_2() {
    let Some(r) = Redis::new() else { return };
    let dir = tempfile::tempdir().expect("a temporary directory");
    let q = r.fresh_queue("redis-claim").await;
    r.run(&[
        b"XGROUP",
        b"CREATE",
        q.as_bytes(),
        b"lazaret",
        b"0",
        b"MKSTREAM",
    ])
    .await;
    r.produce(&q, "m-abandoned", b"x", Map::new()).await;
    // Another consumer of the group reads it and dies without acking.
    r.run(&[
        b"XREADGROUP",
        b"GROUP",
        b"lazaret",
        b"crashed-worker",
        b"COUNT",
        b"1",
        b"STREAMS",
        q.as_bytes(),
        b">",
    ])
    .await;
    r.produce(&q, "m-new", b"y", Map::new()).await;

    let log = Log::default();
    let host = common::host(
        dir.path(),
        common::policies(TYPE, 3, Duration::from_millis(100)),
    );
    let spec = r.spec_with("redis-claim", &q, Mode::Guard, Duration::from_millis(500));
    let running = common::start_guard(
        &r,
        spec,
        host,
        common::recording(&log, |_| Outcome::Success),
        Faults::default(),
    )
    .await;
    let seen = log
        .wait_for(Duration::from_secs(10), |s| s.len() >= 2)
        .await;
    r.wait_settled(&q).await;
    running.stop().await.expect("the guard stops cleanly");

    let attempt = |id: &str| seen.iter().find(|s| s.message_id == id).map(|s| s.attempt);
    assert_eq!(attempt("m-new"), Some(1), "{seen:#?}");
    assert_eq!(
        attempt("m-abandoned"),
        Some(2),
        "the dead consumer's delivery is charged: {seen:#?}"
    );
    assert_eq!(seen.len(), 2, "{seen:#?}");
}

#[tokio::test]
async fn a_running_entry_keeps_its_count_and_a_release_charges_nothing() {
    let Some(r) = Redis::new() else { return };
    let q = r.fresh_queue("redis-progress").await;
    let spec = r.spec_with(
        "redis-progress",
        &q,
        Mode::Guard,
        Duration::from_millis(500),
    );
    let b = broker(&spec).await;
    let mut consumer = b.consume().await.expect("consume");
    let id = r.xadd(&q, &[("body", b"z")]).await;

    let first = next(&mut consumer).await;
    assert_eq!(first.delivery.message_id, id);
    assert_eq!(
        (first.delivery.broker_prior, first.delivery.redelivered),
        (0, false)
    );

    // Idle past the claim threshold, yet renewed: nobody may claim it, and
    // the renewal is no delivery.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        first.ack.progress().await.expect("progress");
    }
    let (owner, idle, count) = r.pending_entry(&q, &id).await.expect("still pending");
    assert!(idle < 300, "progress resets the idle time: {idle} ms");
    assert_eq!(count, 1, "XCLAIM JUSTID leaves the delivery count alone");
    let _ = owner;

    // lazaret could not record it: handed back, it comes again soon,
    // uncharged.
    first.ack.release().await.expect("release");
    let again = next(&mut consumer).await;
    assert_eq!(again.delivery.message_id, id);
    assert_eq!(
        (again.delivery.broker_prior, again.delivery.redelivered),
        (0, false)
    );
    again.ack.ack().await.expect("ack");
    assert_eq!(r.pending(&q, "lazaret").await, 0);
}

#[tokio::test]
async fn a_permanent_failure_is_one_dead_letter_and_a_redrive_sends_it_back() {
    let Some(r) = Redis::new() else { return };
    let dir = tempfile::tempdir().expect("a temporary directory");
    let q = r.fresh_queue("redis-permanent").await;
    r.produce(
        &q,
        "m-bad",
        b"{\"n\": 1}",
        common::headers(json!({"tenant": "acme"})),
    )
    .await;
    let log = Log::default();
    let host = common::host(
        dir.path(),
        common::policies(TYPE, 3, Duration::from_millis(100)),
    );
    let spec = r.spec("redis-permanent", &q, Mode::Guard);
    let running = common::start_guard(
        &r,
        spec.clone(),
        Arc::clone(&host),
        common::recording(&log, |_| {
            Outcome::Failure(
                Failure::new("bad_order", "no such product").with_class(FailureClass::Permanent),
            )
        }),
        Faults::default(),
    )
    .await;
    let dls =
        common::wait_dead_letters(host.store(), "redis-permanent", 1, Duration::from_secs(10))
            .await;
    r.wait_settled(&q).await;
    running.stop().await.expect("the guard stops cleanly");

    assert_eq!(log.all().len(), 1, "delivered once");
    let dl = &dls[0];
    assert_eq!(dl.reason, DeadLetterReason::Permanent);
    assert_eq!(dl.stage, Stage::Processing);
    let src = dl.source.as_ref().expect("a source dead letter");
    assert_eq!(src.broker, "redis");
    assert_eq!(src.queue, q);
    assert_eq!(src.message_id, "m-bad");
    assert_eq!(
        Value::Object(src.headers.clone()),
        json!({"tenant": "acme"})
    );
    let entry_id = src.position["entry_id"]
        .as_str()
        .expect("an entry id")
        .to_owned();
    assert!(entry_id.contains('-'), "{entry_id}");

    // The entry is still in the stream (acked, not deleted); drop it so
    // take_one sees the redrive.
    r.run(&[b"XDEL", q.as_bytes(), entry_id.as_bytes()]).await;
    let mut set = SourceSet::default();
    set.insert(spec.clone(), broker(&spec).await);
    let payload = host
        .store()
        .dead_letter_payload(dl.id)
        .await
        .expect("read the payload")
        .flatten()
        .expect("a payload");
    let sent = set.redrive(dl, payload).await.expect("redrive");
    assert_eq!(sent, "m-bad");
    let (body, headers) = r
        .take_one(&q, Duration::from_secs(5))
        .await
        .expect("the redrive's entry");
    assert_eq!(body, b"{\"n\": 1}");
    let mut headers = headers;
    // Each redrive request's own id: never taken for the dead letter.
    let redrive_id = headers.remove("x-lazaret-redrive-id");
    assert!(
        redrive_id
            .as_ref()
            .and_then(Value::as_str)
            .is_some_and(|id| !id.is_empty()),
        "{redrive_id:?}"
    );
    assert_eq!(
        Value::Object(headers),
        json!({
            "message_id": "m-bad",
            "tenant": "acme",
            "x-lazaret-message-id": "m-bad",
            "x-lazaret-attempt": "0",
        })
    );
}

#[tokio::test]
async fn a_watch_source_takes_in_a_dead_stream_entry() {
    let Some(r) = Redis::new() else { return };
    let dir = tempfile::tempdir().expect("a temporary directory");
    let (dead, original) = r
        .broker_dead_letter("redis-watch", "m-dead", b"{\"id\": 7}")
        .await;
    let host = common::host(
        dir.path(),
        common::policies(TYPE, 3, Duration::from_millis(100)),
    );
    let mut spec = r.spec("redis-watch", &dead, Mode::Watch);
    // The original queue comes from the message: allowed as the server
    // allows its config's own queues.
    spec.redrive_allow = vec![original.clone()];
    let running = common::start_watch(spec.clone(), Arc::clone(&host), Faults::default()).await;
    let dls =
        common::wait_dead_letters(host.store(), "redis-watch", 1, Duration::from_secs(10)).await;
    r.wait_settled(&dead).await;
    running.stop().await.expect("the watch stops cleanly");

    let dl = &dls[0];
    assert_eq!(dl.stage, Stage::Broker);
    assert_eq!(dl.reason, r.broker_reason());
    assert_eq!(dl.attempts, 5);
    let err = dl.error.as_ref().expect("the error text");
    assert_eq!(err.kind.as_str(), "max_deliveries");
    assert_eq!(
        err.message,
        "gave up after 5 deliveries: payment service refused"
    );
    let src = dl.source.as_ref().expect("a source dead letter");
    assert_eq!(src.broker, "redis");
    assert_eq!(src.queue, original);
    assert_eq!(src.message_id, "m-dead");
    assert_eq!(dl.tenant.as_deref(), Some("default"));
    assert_eq!(
        Value::Object(src.headers.clone()),
        json!({"tenant": "acme"}),
        "the dead stream's own fields are not the message's headers"
    );
    assert!(src.position["entry_id"].is_string(), "{:?}", src.position);

    // Back to where it died, as a first delivery there.
    let mut set = SourceSet::default();
    set.insert(spec.clone(), broker(&spec).await);
    let sent = set
        .redrive(dl, b"{\"id\": 7}".to_vec())
        .await
        .expect("redrive");
    assert_eq!(sent, "m-dead");
    let dir2 = tempfile::tempdir().expect("a temporary directory");
    let log = Log::default();
    let guard = r.spec("redis-watch-back", &original, Mode::Guard);
    let running = common::start_guard(
        &r,
        guard,
        common::host(
            dir2.path(),
            common::policies(TYPE, 3, Duration::from_millis(100)),
        ),
        common::recording(&log, |_| Outcome::Success),
        Faults::default(),
    )
    .await;
    let seen = log
        .wait_for(Duration::from_secs(10), |s| !s.is_empty())
        .await;
    running.stop().await.expect("the guard stops cleanly");
    assert_eq!(
        seen,
        vec![Seen {
            message_id: "m-dead".into(),
            attempt: 1,
            body: b"{\"id\": 7}".to_vec()
        }]
    );
}

#[tokio::test]
async fn a_published_entry_reads_back_as_it_was_sent() {
    let Some(r) = Redis::new() else { return };
    let q = r.fresh_queue("redis-publish").await;
    let spec = r.spec("redis-publish", &q, Mode::Guard);
    let b = broker(&spec).await;
    b.publish(Republish {
        queue: q.clone(),
        body: vec![0xff, 0xfe],
        content_type: Some("application/octet-stream".into()),
        headers: common::headers(json!({"bin": {"base64": "/wA="}, "n": 3, "s": "t"})),
        message_id: "m-pub".into(),
        dedup_id: "unused".into(),
        position: Value::Null,
    })
    .await
    .expect("publish");
    let mut c = b.consume().await.expect("consume");
    let got = tokio::time::timeout(Duration::from_secs(10), c.next())
        .await
        .expect("within 10 s")
        .expect("read")
        .expect("open");
    assert_eq!(got.delivery.message_id, "m-pub");
    assert_eq!(got.delivery.body, vec![0xff, 0xfe]);
    assert_eq!(
        got.delivery.content_type.as_deref(),
        Some("application/octet-stream")
    );
    assert_eq!(
        Value::Object(got.delivery.headers.clone()),
        json!({"bin": {"base64": "/wA="}, "n": "3", "s": "t"})
    );
    got.ack.ack().await.expect("ack");
}

#[tokio::test]
async fn a_wrong_url_is_a_connect_error_without_the_password() {
    if Redis::new().is_none() {
        return;
    }
    let spec = SourceSpec::guard(
        "redis-nowhere",
        BrokerKind::Redis,
        "redis://user:hunter2@127.0.0.1:1/",
        "nowhere",
        TYPE,
    );
    let Err(err) = lazaret_guard::connect(&spec).await else {
        panic!("connected to port 1");
    };
    let text = err.to_string();
    assert!(
        matches!(err, lazaret_guard::BrokerError::Connect { .. }),
        "{text}"
    );
    assert!(!text.contains("hunter2"), "{text}");
}

#[tokio::test]
async fn a_guard_comes_back_after_redis_drops_its_connections() {
    let Some(base) = Redis::new() else { return };
    // A database of its own, so that only this test's connections are
    // dropped: the others run alongside on the same server.
    const DB: &str = "13";
    let trimmed = base.url.trim_end_matches('/');
    let server = match trimmed.rsplit_once('/') {
        Some((head, db)) if !head.ends_with('/') && db.chars().all(|c| c.is_ascii_digit()) => head,
        _ => trimmed,
    };
    let url = format!("{server}/{DB}");
    let r = Redis {
        client: Client::open(url.as_str()).expect("a valid URL"),
        url,
    };
    let dir = tempfile::tempdir().expect("a temporary directory");
    let q = r.fresh_queue("redis-drop").await;
    let log = Log::default();
    let host = common::host(
        dir.path(),
        common::policies(TYPE, 3, Duration::from_millis(100)),
    );
    let spec = r.spec_with("redis-drop", &q, Mode::Guard, Duration::from_millis(500));
    let running = common::start_guard(
        &r,
        spec,
        host,
        common::recording(&log, |_| Outcome::Success),
        Faults::default(),
    )
    .await;
    r.produce(&q, "before", b"1", Map::new()).await;
    log.wait_for(Duration::from_secs(10), |s| s.len() == 1)
        .await;

    let RValue::BulkString(list) = base.run(&[b"CLIENT", b"LIST"]).await else {
        panic!("CLIENT LIST")
    };
    let mut killed = 0;
    for line in String::from_utf8_lossy(&list).lines() {
        let field = |name: &str| {
            line.split(' ')
                .find_map(|kv| kv.strip_prefix(name).and_then(|v| v.strip_prefix('=')))
        };
        if field("db") == Some(DB) {
            if let Some(id) = field("id") {
                base.run(&[b"CLIENT", b"KILL", b"ID", id.as_bytes()]).await;
                killed += 1;
            }
        }
    }
    assert!(
        killed >= 2,
        "the guard's reading and shared connections: {killed}"
    );

    r.produce(&q, "after", b"2", Map::new()).await;
    let seen = log
        .wait_for(Duration::from_secs(20), |s| {
            s.iter().any(|x| x.message_id == "after")
        })
        .await;
    r.wait_settled(&q).await;
    running.stop().await.expect("the guard stops cleanly");
    assert_eq!(
        seen.iter()
            .map(|s| (s.message_id.as_str(), s.attempt))
            .collect::<Vec<_>>(),
        vec![("before", 1), ("after", 1)]
    );
}

crate::scenarios::scenario_suite!(crate::redis::redis_or_skip());
