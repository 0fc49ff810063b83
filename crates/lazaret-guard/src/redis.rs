//! The Redis Streams adapter: a source's `queue` is a stream key, its
//! `group` a consumer group on it.
//!
//! # Guard mode
//!
//! lazaret reads the stream as one consumer of the group, named
//! `<group>-<hostname or pid>-<random suffix>` so that two lazaret
//! processes never share a consumer (and so never each other's pending
//! entries). An entry maps onto a delivery as the contract's table says:
//!
//! - body: the field `body`, else `payload`, else empty;
//! - message id: the field `message_id`, else the entry id
//!   (`x-lazaret-message-id` wins, as for every broker);
//! - content type: the field `content_type` (or `content-type`);
//! - headers: every other field (a value that is not UTF-8 as
//!   `{"base64": …}`);
//! - the broker's count of earlier deliveries: the entry's delivery count
//!   in the group's pending entries list, minus one;
//! - position: `{"entry_id": "1700000000000-0"}`.
//!
//! Redis never redelivers a pending entry by itself: an entry stays with the
//! consumer that read it until someone claims it. lazaret claims, every few
//! seconds, the entries that have been pending for longer than twice the
//! source's `delivery_timeout_ms` (`XAUTOCLAIM`): those of a consumer that
//! died mid-message, whichever process it was. While a delivery runs,
//! lazaret keeps its entry's idle time low (`XCLAIM … JUSTID`, which leaves
//! the delivery count alone), so a live delivery never looks dead.
//!
//! # Watch mode
//!
//! Redis has no dead-letter queue of its own: applications copy the entries
//! they give up on to a stream of their own. lazaret reads such a *dead
//! stream* in this format (every field optional):
//!
//! | field | meaning |
//! |---|---|
//! | `body` (or `payload`) | the original entry's body |
//! | `message_id` | the original message id (else `original_id`) |
//! | `reason` | a lazaret broker reason word: `rejected`, `expired`, `maxlen`, `delivery_limit`, `max_receives`, `max_deliveries`, `listener_failed`; absent or unknown: `rejected` |
//! | `error` | the error text, kept as the dead letter's error (its kind: the reason word, else `error`) |
//! | `original_stream` | the stream the entry was on: where a redrive sends it back |
//! | `original_id` | its entry id there |
//! | `delivery_count` | how often it was delivered: the dead letter's attempts |
//! | `failed_at` | when it was given up, in milliseconds since the epoch |
//! | `content_type` (or `content-type`) | the body's content type |
//! | anything else | the original entry's own fields: the dead letter's headers |
//!
//! For example:
//!
//! ```text
//! XADD orders-dead * body '{"id": 7}' message_id order-7 reason max_deliveries \
//!     error "payment service refused: card expired" original_stream orders \
//!     original_id 1700000000000-0 delivery_count 5 failed_at 1700000300000 tenant acme
//! ```
//!
//! A redrive publishes the message back to `original_stream` (or
//! `redrive_to`) with `XADD`: fields `body`, `message_id`, `content_type`
//! and its headers, plus `x-lazaret-message-id` and `x-lazaret-attempt: 0`.
//!
//! Redis enforces no delivery limit of its own, so there is nothing to warn
//! about at start.

use std::collections::hash_map::RandomState;
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::future::BoxFuture;
use lazaret_core::{DeadLetterReason, Failure, Timestamp};
use redis::aio::{ConnectionManager, ConnectionManagerConfig, MultiplexedConnection};
use redis::{AsyncConnectionConfig, Client, RedisError, Value};
use serde_json::{Map, Value as Json, json};
use tokio::time::Instant;

use crate::broker::{Acker, Broker, BrokerError, Consumer, Incoming};
use crate::message::TakenIn;
use crate::message::{Delivery, Republish, bytes_value, value_bytes};
use crate::spec::SourceSpec;
use lazaret_core::mask_url;

const BROKER: &str = "redis";

/// How long one `XREADGROUP` blocks for: `next()` then returns to the
/// runtime's select, so a shutdown never waits on the broker for longer.
const BLOCK: Duration = Duration::from_secs(1);
/// How long an answer may take on the reading connection (it blocks for
/// [`BLOCK`] itself, so the client's 500 ms default would cut every read).
const READ_RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an answer may take on the shared connection (acks, claims,
/// publishes).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The shortest idle time after which a pending entry counts as abandoned,
/// whatever the delivery timeout: the runtime renews running entries only
/// every 500 ms at the most often.
const MIN_IDLE_FLOOR: Duration = Duration::from_secs(1);

/// The fields that hold the body, the first present wins; the body, message
/// id and content type fields are not headers.
const BODY_FIELDS: [&str; 2] = ["body", "payload"];
/// The field that holds the message id.
const MESSAGE_ID_FIELD: &str = "message_id";
/// The fields that hold the content type, the first present wins.
const CONTENT_TYPE_FIELDS: [&str; 2] = ["content_type", "content-type"];

/// The fields of a dead-stream entry that describe its death rather than
/// the message: dropped from the headers of the message taken in.
const DEAD_FIELDS: [&str; 6] = [
    "reason",
    "error",
    "original_stream",
    "original_id",
    "delivery_count",
    "failed_at",
];

/// Opens the adapter: a client and a connection that reconnects by itself
/// (for acknowledgements, claims and publishes). Each consumer opens a
/// connection of its own, since a blocking `XREADGROUP` holds up every
/// command behind it on its connection.
pub async fn connect(spec: &SourceSpec) -> Result<Box<dyn Broker>, BrokerError> {
    let url = mask_url(&spec.url);
    let client = Client::open(spec.url.as_str()).map_err(|e| BrokerError::Connect {
        broker: BROKER,
        url: url.clone(),
        why: e.to_string(),
    })?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(CONNECT_TIMEOUT))
        .set_response_timeout(Some(RESPONSE_TIMEOUT))
        .set_number_of_retries(2);
    let conn = ConnectionManager::new_with_config(client.clone(), config)
        .await
        .map_err(|e| BrokerError::Connect {
            broker: BROKER,
            url: url.clone(),
            why: e.to_string(),
        })?;
    let min_idle = (spec.delivery_timeout * 2).max(MIN_IDLE_FLOOR);
    Ok(Box::new(Redis {
        client,
        shared: Arc::new(Shared {
            url,
            stream: spec.queue.clone(),
            group: spec.group.clone(),
            consumer: consumer_name(&spec.group),
            conn,
            min_idle,
        }),
    }))
}

/// What the broker, its consumers and their ackers share.
struct Shared {
    /// The URL without its password, for errors.
    url: String,
    stream: String,
    group: String,
    /// This process's consumer name in the group.
    consumer: String,
    /// Acknowledgements, claims and publishes (never a blocking read).
    conn: ConnectionManager,
    /// Pending for longer than this, an entry's consumer is taken for dead.
    min_idle: Duration,
}

impl Shared {
    fn min_idle_ms(&self) -> u64 {
        u64::try_from(self.min_idle.as_millis()).unwrap_or(u64::MAX)
    }

    /// A Redis error as a broker error: a lost connection as `Connect`
    /// (the runtime reconnects), anything else as `Op`.
    fn error(&self, op: impl Into<String>, e: &RedisError) -> BrokerError {
        if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
            BrokerError::Connect {
                broker: BROKER,
                url: self.url.clone(),
                why: e.to_string(),
            }
        } else {
            let mut why = e.to_string();
            if e.code() == Some("NOGROUP") {
                why.push_str(
                    " (the stream or its consumer group was deleted; lazaret creates them again on reconnect)",
                );
            }
            BrokerError::Op {
                broker: BROKER,
                op: op.into(),
                why,
            }
        }
    }
}

/// The Redis Streams broker of one source.
pub struct Redis {
    client: Client,
    shared: Arc<Shared>,
}

impl fmt::Debug for Redis {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Redis")
            .field("url", &self.shared.url)
            .field("stream", &self.shared.stream)
            .field("group", &self.shared.group)
            .field("consumer", &self.shared.consumer)
            .finish_non_exhaustive()
    }
}

impl Broker for Redis {
    fn kind(&self) -> &'static str {
        BROKER
    }

    /// Opens a reading connection and creates the consumer group if it is
    /// not there (`XGROUP CREATE <stream> <group> 0 MKSTREAM`).
    ///
    /// The group starts at `0`, the beginning of the stream, not at `$`:
    /// entries that producers added before lazaret first started (or while
    /// it was not deployed yet) are processed too rather than silently
    /// skipped. A group that exists already keeps its position.
    fn consume(&self) -> BoxFuture<'_, Result<Box<dyn Consumer>, BrokerError>> {
        Box::pin(async move {
            let shared = &self.shared;
            let config = AsyncConnectionConfig::new()
                .set_connection_timeout(Some(CONNECT_TIMEOUT))
                .set_response_timeout(Some(READ_RESPONSE_TIMEOUT));
            let mut conn = self
                .client
                .get_multiplexed_async_connection_with_config(&config)
                .await
                .map_err(|e| BrokerError::Connect {
                    broker: BROKER,
                    url: shared.url.clone(),
                    why: e.to_string(),
                })?;
            let created = redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(&shared.stream)
                .arg(&shared.group)
                .arg("0")
                .arg("MKSTREAM")
                .query_async::<Value>(&mut conn)
                .await;
            match created {
                Ok(_) => {}
                Err(e) if e.code() == Some("BUSYGROUP") => {}
                Err(e) => {
                    return Err(shared.error(
                        format!(
                            "creating the consumer group {} on stream {}",
                            shared.group, shared.stream
                        ),
                        &e,
                    ));
                }
            }
            let claim_every =
                (shared.min_idle / 2).clamp(Duration::from_millis(500), Duration::from_secs(5));
            Ok(Box::new(StreamConsumer {
                shared: Arc::clone(shared),
                conn,
                claim_cursor: "0-0".into(),
                // Claim first: a restarted lazaret picks up what its
                // predecessor left before it reads anything new.
                claim_due: Instant::now(),
                claim_every,
            }) as Box<dyn Consumer>)
        })
    }

    fn publish(&self, msg: Republish) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(async move {
            let mut conn = self.shared.conn.clone();
            let mut cmd = redis::cmd("XADD");
            cmd.arg(&msg.queue).arg("*");
            for (field, value) in publish_fields(&msg) {
                cmd.arg(field).arg(value);
            }
            match cmd.query_async::<Value>(&mut conn).await {
                Ok(
                    Value::BulkString(_) | Value::SimpleString(_) | Value::VerbatimString { .. },
                ) => Ok(()),
                Ok(other) => Err(BrokerError::NotConfirmed {
                    broker: BROKER,
                    queue: msg.queue.clone(),
                    why: format!("XADD answered {other:?} instead of the new entry's id"),
                }),
                Err(e) => Err(BrokerError::NotConfirmed {
                    broker: BROKER,
                    queue: msg.queue.clone(),
                    why: format!("XADD failed: {e}"),
                }),
            }
        })
    }

    fn interpret<'a>(&'a self, d: &'a Delivery) -> BoxFuture<'a, Result<TakenIn, BrokerError>> {
        Box::pin(async move { Ok(interpret(d)) })
    }
}

/// The fields `XADD` writes for a republished message, in order: `body`,
/// `message_id`, `content_type` when known, then the headers (strings as
/// they are, `{"base64"}` decoded to bytes, other JSON as its text). A
/// header named like one of the first three is left out, so that reading
/// the entry back gives the same message.
pub fn publish_fields(msg: &Republish) -> Vec<(String, Vec<u8>)> {
    let mut fields = vec![
        ("body".to_owned(), msg.body.clone()),
        (
            MESSAGE_ID_FIELD.to_owned(),
            msg.message_id.clone().into_bytes(),
        ),
    ];
    if let Some(ct) = &msg.content_type {
        fields.push(("content_type".to_owned(), ct.clone().into_bytes()));
    }
    for (name, value) in &msg.headers {
        if is_reserved(name) {
            continue;
        }
        fields.push((name.clone(), value_bytes(value)));
    }
    fields
}

fn is_reserved(name: &str) -> bool {
    BODY_FIELDS.contains(&name) || name == MESSAGE_ID_FIELD || CONTENT_TYPE_FIELDS.contains(&name)
}

/// Reads the group: claims abandoned entries every few seconds, else
/// waits for new ones.
struct StreamConsumer {
    shared: Arc<Shared>,
    /// Only this consumer's reads: a blocking `XREADGROUP` holds up every
    /// command behind it on its connection.
    conn: MultiplexedConnection,
    /// Where the running `XAUTOCLAIM` scan of the pending entries is.
    claim_cursor: String,
    /// When the next scan starts.
    claim_due: Instant,
    /// How often the pending entries are scanned.
    claim_every: Duration,
}

impl Consumer for StreamConsumer {
    /// One entry at a time, and only when asked: `XAUTOCLAIM … COUNT 1`
    /// and `XREADGROUP … COUNT 1`. Reading ahead would leave entries
    /// pending in a buffer while the runtime waits (a full set of
    /// deliveries, an open breaker, a pause), where nothing renews them:
    /// after the idle time they would be claimed by another process and
    /// delivered twice, or by this one with a delivery charged.
    ///
    /// An entry whose read is cut short by a shutdown stays pending under
    /// this consumer; the next lazaret claims it, its delivery count then
    /// one higher.
    fn next(&mut self) -> BoxFuture<'_, Result<Option<Incoming>, BrokerError>> {
        Box::pin(async move {
            loop {
                if Instant::now() >= self.claim_due {
                    if let Some(incoming) = self.claim().await? {
                        return Ok(Some(incoming));
                    }
                }
                if let Some(incoming) = self.read().await? {
                    return Ok(Some(incoming));
                }
            }
        })
    }
}

impl StreamConsumer {
    /// Scans the pending entries for one idle for longer than `min_idle`
    /// and claims it; `None` once the scan is through.
    async fn claim(&mut self) -> Result<Option<Incoming>, BrokerError> {
        let s = Arc::clone(&self.shared);
        loop {
            let reply = redis::cmd("XAUTOCLAIM")
                .arg(&s.stream)
                .arg(&s.group)
                .arg(&s.consumer)
                .arg(s.min_idle_ms())
                .arg(&self.claim_cursor)
                .arg("COUNT")
                .arg(1)
                .query_async::<Value>(&mut self.conn)
                .await
                .map_err(|e| s.error(format!("XAUTOCLAIM on stream {}", s.stream), &e))?;
            let (cursor, entries) = parse_autoclaim(reply).map_err(|why| BrokerError::Op {
                broker: BROKER,
                op: format!("XAUTOCLAIM on stream {}", s.stream),
                why,
            })?;
            let done = cursor == "0-0";
            self.claim_cursor = cursor;
            if done {
                self.claim_due = Instant::now() + self.claim_every;
            }
            for entry in entries {
                // XAUTOCLAIM counted this delivery; XPENDING says how many
                // there were in all.
                if let Some(count) = self.delivery_count(&entry.id).await? {
                    return Ok(Some(self.incoming(entry, count)));
                }
            }
            if done {
                return Ok(None);
            }
        }
    }

    /// The delivery count of one pending entry; `None` when it is no longer
    /// pending (acknowledged meanwhile by its former consumer).
    async fn delivery_count(&mut self, id: &str) -> Result<Option<u64>, BrokerError> {
        let s = Arc::clone(&self.shared);
        let reply = redis::cmd("XPENDING")
            .arg(&s.stream)
            .arg(&s.group)
            .arg(id)
            .arg(id)
            .arg(1)
            .query_async::<Value>(&mut self.conn)
            .await
            .map_err(|e| s.error(format!("XPENDING of {id} on stream {}", s.stream), &e))?;
        Ok(parse_pending_count(&reply))
    }

    /// Waits up to [`BLOCK`] for one new entry.
    async fn read(&mut self) -> Result<Option<Incoming>, BrokerError> {
        let s = Arc::clone(&self.shared);
        let reply = redis::cmd("XREADGROUP")
            .arg("GROUP")
            .arg(&s.group)
            .arg(&s.consumer)
            .arg("COUNT")
            .arg(1)
            .arg("BLOCK")
            .arg(u64::try_from(BLOCK.as_millis()).unwrap_or(1000))
            .arg("STREAMS")
            .arg(&s.stream)
            .arg(">")
            .query_async::<Value>(&mut self.conn)
            .await
            .map_err(|e| s.error(format!("XREADGROUP on stream {}", s.stream), &e))?;
        let entries = parse_read(reply).map_err(|why| BrokerError::Op {
            broker: BROKER,
            op: format!("XREADGROUP on stream {}", s.stream),
            why,
        })?;
        // A fresh read is the entry's first delivery.
        Ok(entries.into_iter().next().map(|e| self.incoming(e, 1)))
    }

    fn incoming(&self, entry: Entry, count: u64) -> Incoming {
        let delivery = entry_delivery(&self.shared.stream, &entry, count);
        Incoming {
            delivery,
            ack: Box::new(EntryAcker {
                shared: Arc::clone(&self.shared),
                id: entry.id,
                count,
            }),
        }
    }
}

/// Settles one pending entry.
struct EntryAcker {
    shared: Arc<Shared>,
    id: String,
    /// Its delivery count when it was handed over.
    count: u64,
}

impl Acker for EntryAcker {
    /// `XACK`: the entry leaves the group's pending entries (it stays in
    /// the stream; trimming it is the stream owner's business).
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), BrokerError>> {
        Box::pin(async move {
            let s = &self.shared;
            let mut conn = s.conn.clone();
            redis::cmd("XACK")
                .arg(&s.stream)
                .arg(&s.group)
                .arg(&self.id)
                .query_async::<Value>(&mut conn)
                .await
                .map(drop)
                .map_err(|e| s.error(format!("XACK of {} on stream {}", self.id, s.stream), &e))
        })
    }

    /// `XCLAIM <stream> <group> <me> 0 <id> JUSTID`: resets the entry's
    /// idle time so no one claims it while it runs. `JUSTID` leaves its
    /// delivery count as it is.
    fn progress(&self) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(async move {
            let s = &self.shared;
            let mut conn = s.conn.clone();
            redis::cmd("XCLAIM")
                .arg(&s.stream)
                .arg(&s.group)
                .arg(&s.consumer)
                .arg(0)
                .arg(&self.id)
                .arg("JUSTID")
                .query_async::<Value>(&mut conn)
                .await
                .map(drop)
                .map_err(|e| s.error(format!("XCLAIM of {} on stream {}", self.id, s.stream), &e))
        })
    }

    /// Redis has no "give back": the entry stays pending. It is marked idle
    /// for the whole claim threshold, with its delivery count one lower
    /// (`XCLAIM … IDLE <min-idle> RETRYCOUNT <count − 1> JUSTID`), so the
    /// next claim (this process's or another's) delivers it again within
    /// a few seconds with the count it had: a hand-back lazaret caused
    /// charges no attempt. If even that fails, it is claimed after the idle
    /// time anyway, its count then one higher.
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), BrokerError>> {
        Box::pin(async move {
            let s = &self.shared;
            let mut conn = s.conn.clone();
            redis::cmd("XCLAIM")
                .arg(&s.stream)
                .arg(&s.group)
                .arg(&s.consumer)
                .arg(0)
                .arg(&self.id)
                .arg("IDLE")
                .arg(s.min_idle_ms())
                .arg("RETRYCOUNT")
                .arg(self.count.saturating_sub(1))
                .arg("JUSTID")
                .query_async::<Value>(&mut conn)
                .await
                .map(drop)
                .map_err(|e| {
                    s.error(
                        format!("handing back {} on stream {}", self.id, s.stream),
                        &e,
                    )
                })
        })
    }
}

/// One stream entry: its id and its fields in order.
#[derive(Clone, Debug, PartialEq)]
struct Entry {
    id: String,
    fields: Vec<(String, Vec<u8>)>,
}

/// An entry as a delivery, `count` its delivery count (1: first delivery).
fn entry_delivery(stream: &str, entry: &Entry, count: u64) -> Delivery {
    let field = |name: &str| entry.fields.iter().find(|(k, _)| k == name).map(|(_, v)| v);
    let body_field = BODY_FIELDS.into_iter().find(|f| field(f).is_some());
    let ct_field = CONTENT_TYPE_FIELDS.into_iter().find(|f| field(f).is_some());
    let message_id = field(MESSAGE_ID_FIELD)
        .map(|v| String::from_utf8_lossy(v).into_owned())
        .filter(|id| !id.is_empty())
        .unwrap_or_else(|| entry.id.clone());
    let mut headers = Map::new();
    for (name, value) in &entry.fields {
        let taken = Some(name.as_str()) == body_field
            || name == MESSAGE_ID_FIELD
            || Some(name.as_str()) == ct_field;
        if !taken {
            headers.insert(name.clone(), bytes_value(value));
        }
    }
    Delivery {
        message_id,
        body: body_field.and_then(field).cloned().unwrap_or_default(),
        content_type: ct_field
            .and_then(field)
            .map(|v| String::from_utf8_lossy(v).into_owned()),
        headers,
        broker_prior: u32::try_from(count.saturating_sub(1)).unwrap_or(u32::MAX),
        redelivered: count > 1,
        queue: stream.to_owned(),
        position: json!({ "entry_id": entry.id }),
    }
}

/// What an entry of a dead stream (the module's format) says of itself.
/// Pure: the watch runtime files the result.
pub fn interpret(d: &Delivery) -> TakenIn {
    let get = |name: &str| d.header(name).filter(|v| !v.is_empty());
    let word = get("reason");
    let reason = word.as_deref().and_then(broker_reason);
    let error = get("error").map(|text| {
        let kind = word.clone().unwrap_or_else(|| "error".to_owned());
        let mut f = Failure::new(kind, text);
        f.truncate_to_caps();
        f
    });
    let original_queue = get("original_stream");
    let original_id = get("original_id");
    let attempts = get("delivery_count")
        .and_then(|c| c.trim().parse::<u64>().ok())
        .map_or(0, |c| u32::try_from(c).unwrap_or(u32::MAX));
    let first_at = get("failed_at")
        .and_then(|t| t.trim().parse::<i64>().ok())
        .map(Timestamp::from_millis);

    let mut original = d.clone();
    original
        .headers
        .retain(|k, _| !DEAD_FIELDS.iter().any(|f| k.eq_ignore_ascii_case(f)));
    if !has_message_id_field(d) {
        // The dead entry named no message id: the original entry's id is
        // the message id, as it was on the original stream.
        if let Some(id) = &original_id {
            original.message_id = id.clone();
        }
    }
    if let Some(q) = &original_queue {
        original.queue = q.clone();
    }
    if let Some(id) = &original_id {
        original.position = json!({ "entry_id": id });
    }
    original.broker_prior = 0;
    original.redelivered = false;
    original.resolve_id();

    TakenIn {
        reason,
        error,
        original_queue,
        original_position: original_id.map(|id| json!({ "entry_id": id })),
        attempts,
        first_at,
        original: Some(original),
    }
}

/// Whether the delivery's id came from a `message_id` field rather than
/// from the entry id (the mapping takes the field out of the headers, so
/// the two are told apart by the id's shape).
fn has_message_id_field(d: &Delivery) -> bool {
    let entry_id = d.position.get("entry_id").and_then(Json::as_str);
    entry_id != Some(d.message_id.as_str())
}

/// A broker reason word; `None` (filed as `rejected`) for an unknown one or
/// a reason that is not a broker's.
fn broker_reason(word: &str) -> Option<DeadLetterReason> {
    let word = word.trim();
    DeadLetterReason::ALL
        .into_iter()
        .find(|r| r.is_broker() && r.as_str().eq_ignore_ascii_case(word))
}

/// `<group>-<hostname or pid>-<random suffix>`: never shared by two
/// processes, even two on one host started from one image.
fn consumer_name(group: &str) -> String {
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| {
            h.trim()
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
                .collect::<String>()
        })
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| format!("pid{}", std::process::id()));
    format!("{group}-{host}-{:08x}", random_u32())
}

/// A random number without a dependency: std's hasher keys are random per
/// process, mixed with the clock and the pid.
fn random_u32() -> u32 {
    let mut h = RandomState::new().build_hasher();
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(nanos);
    h.write_u32(std::process::id());
    (h.finish() >> 32) as u32
}

// ---------------------------------------------------------------------
// Replies. RESP2 and RESP3 shapes are both accepted (a URL may ask for
// `?protocol=resp3`).

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        Value::Int(n) => Some(n.to_string()),
        _ => None,
    }
}

fn bytes(v: Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.into_bytes()),
        Value::VerbatimString { text, .. } => Some(text.into_bytes()),
        Value::Int(n) => Some(n.to_string().into_bytes()),
        _ => None,
    }
}

fn int(v: &Value) -> Option<u64> {
    match v {
        Value::Int(n) => u64::try_from(*n).ok(),
        other => text(other).and_then(|t| t.parse().ok()),
    }
}

/// A list of `[id, [field, value, …]]`; an entry deleted from the stream
/// while pending (its fields nil) is left out.
fn parse_entries(v: Value) -> Result<Vec<Entry>, String> {
    let items = match v {
        Value::Nil => return Ok(Vec::new()),
        Value::Array(items) | Value::Set(items) => items,
        other => return Err(format!("expected a list of entries, got {other:?}")),
    };
    let mut entries = Vec::with_capacity(items.len());
    for item in items {
        let Value::Array(mut pair) = item else {
            return Err(format!("expected an entry [id, fields], got {item:?}"));
        };
        if pair.len() != 2 {
            return Err(format!("expected an entry [id, fields], got {pair:?}"));
        }
        let raw = pair.pop().unwrap_or(Value::Nil);
        let id =
            text(&pair[0]).ok_or_else(|| format!("an entry id that is not text: {:?}", pair[0]))?;
        let flat: Vec<Value> = match raw {
            Value::Nil => continue,
            Value::Array(f) => f,
            Value::Map(m) => m.into_iter().flat_map(|(k, v)| [k, v]).collect(),
            other => return Err(format!("entry {id}: expected its fields, got {other:?}")),
        };
        let mut fields = Vec::with_capacity(flat.len() / 2);
        let mut it = flat.into_iter();
        while let (Some(k), Some(v)) = (it.next(), it.next()) {
            let name = bytes(k).map(|b| String::from_utf8_lossy(&b).into_owned());
            let value = bytes(v);
            if let (Some(name), Some(value)) = (name, value) {
                fields.push((name, value));
            }
        }
        entries.push(Entry { id, fields });
    }
    Ok(entries)
}

/// `XREADGROUP`'s reply: nil on a timeout, else `[[stream, entries]]`
/// (RESP3: a map of stream to entries).
fn parse_read(v: Value) -> Result<Vec<Entry>, String> {
    let streams: Vec<Value> = match v {
        Value::Nil => return Ok(Vec::new()),
        Value::Array(items) => items
            .into_iter()
            .filter_map(|s| match s {
                Value::Array(mut pair) if pair.len() == 2 => pair.pop(),
                _ => None,
            })
            .collect(),
        Value::Map(m) => m.into_iter().map(|(_, entries)| entries).collect(),
        other => return Err(format!("expected streams of entries, got {other:?}")),
    };
    let mut out = Vec::new();
    for entries in streams {
        out.extend(parse_entries(entries)?);
    }
    Ok(out)
}

/// `XAUTOCLAIM`'s reply: `[next cursor, entries, deleted ids]`.
fn parse_autoclaim(v: Value) -> Result<(String, Vec<Entry>), String> {
    let Value::Array(mut parts) = v else {
        return Err(format!("expected [cursor, entries, deleted], got {v:?}"));
    };
    if parts.len() < 2 {
        return Err(format!(
            "expected [cursor, entries, deleted], got {parts:?}"
        ));
    }
    parts.truncate(2);
    let entries = parts.pop().unwrap_or(Value::Nil);
    let cursor =
        text(&parts[0]).ok_or_else(|| format!("a cursor that is not text: {:?}", parts[0]))?;
    Ok((cursor, parse_entries(entries)?))
}

/// The delivery count in `XPENDING <stream> <group> <id> <id> 1`'s reply
/// (`[[id, consumer, idle, count]]`); `None` when the entry is not pending.
fn parse_pending_count(v: &Value) -> Option<u64> {
    let Value::Array(rows) = v else { return None };
    let Value::Array(row) = rows.first()? else {
        return None;
    };
    row.get(3).and_then(int)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn delivery(fields: &[(&str, &[u8])], id: &str, count: u64) -> Delivery {
        entry_delivery(
            "orders-dead",
            &Entry {
                id: id.into(),
                fields: fields
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), v.to_vec()))
                    .collect(),
            },
            count,
        )
    }

    #[test]
    fn an_entry_maps_onto_a_delivery() {
        let d = delivery(
            &[
                ("body", b"{\"id\": 7}"),
                ("message_id", b"order-7"),
                ("content-type", b"application/json"),
                ("tenant", b"acme"),
                ("blob", &[0xff, 0x00]),
            ],
            "1700000000000-0",
            1,
        );
        assert_eq!(d.message_id, "order-7");
        assert_eq!(d.body, b"{\"id\": 7}");
        assert_eq!(d.content_type.as_deref(), Some("application/json"));
        assert_eq!(
            Json::Object(d.headers.clone()),
            json!({"tenant": "acme", "blob": {"base64": "/wA="}})
        );
        assert_eq!((d.broker_prior, d.redelivered), (0, false));
        assert_eq!(d.position, json!({"entry_id": "1700000000000-0"}));
        assert_eq!(d.queue, "orders-dead");

        let d = delivery(&[("payload", b"p"), ("x", b"y")], "5-1", 3);
        assert_eq!(d.message_id, "5-1", "no message_id field: the entry id");
        assert_eq!(d.body, b"p");
        assert_eq!((d.broker_prior, d.redelivered), (2, true));
        assert_eq!(Json::Object(d.headers), json!({"x": "y"}));

        let d = delivery(&[("body", b"b"), ("payload", b"p")], "5-2", 1);
        assert_eq!(d.body, b"b", "body wins over payload");
        assert_eq!(Json::Object(d.headers), json!({"payload": "p"}));
    }

    #[test]
    fn a_dead_entry_says_why_and_where_from() {
        let mut d = delivery(
            &[
                ("body", b"{\"id\": 7}"),
                ("message_id", b"order-7"),
                ("reason", b"max_deliveries"),
                ("error", b"payment service refused: card expired"),
                ("original_stream", b"orders"),
                ("original_id", b"1700000000000-0"),
                ("delivery_count", b"5"),
                ("failed_at", b"1700000300000"),
                ("tenant", b"acme"),
            ],
            "1700000400000-0",
            1,
        );
        d.resolve_id();
        let t = interpret(&d);
        assert_eq!(t.reason, Some(DeadLetterReason::MaxDeliveries));
        let e = t
            .error
            .clone()
            .unwrap_or_else(|| Failure::new("missing", ""));
        assert_eq!(e.kind.as_str(), "max_deliveries");
        assert_eq!(e.message, "payment service refused: card expired");
        assert_eq!(t.original_queue.as_deref(), Some("orders"));
        assert_eq!(
            t.original_position,
            Some(json!({"entry_id": "1700000000000-0"}))
        );
        assert_eq!(t.attempts, 5);
        assert_eq!(t.first_at, Some(Timestamp::from_millis(1_700_000_300_000)));
        let o = t.original.unwrap_or_else(|| d.clone());
        assert_eq!(o.message_id, "order-7");
        assert_eq!(o.body, b"{\"id\": 7}");
        assert_eq!(o.queue, "orders");
        assert_eq!(o.position, json!({"entry_id": "1700000000000-0"}));
        assert_eq!(Json::Object(o.headers), json!({"tenant": "acme"}));
    }

    #[test]
    fn a_dead_entry_that_says_little_is_rejected() {
        let d = delivery(&[("body", b"x"), ("reason", b"on fire")], "9-0", 1);
        let t = interpret(&d);
        assert_eq!(t.reason, None, "an unknown word is filed as rejected");
        assert_eq!(t.error, None);
        assert_eq!(t.original_queue, None);
        assert_eq!(t.attempts, 0);

        let d = delivery(&[("reason", b"permanent"), ("error", b"boom")], "9-1", 1);
        let t = interpret(&d);
        assert_eq!(t.reason, None, "not a broker's reason");
        assert_eq!(
            t.error.map(|e| (e.kind.to_string(), e.message)),
            Some(("permanent".into(), "boom".into()))
        );

        let d = delivery(&[("error", b"boom"), ("original_id", b"3-0")], "9-2", 1);
        let t = interpret(&d);
        assert_eq!(t.error.map(|e| e.kind.to_string()), Some("error".into()));
        assert_eq!(
            t.original.map(|o| o.message_id),
            Some("3-0".into()),
            "no message_id: the original entry id"
        );
    }

    #[test]
    fn a_republish_writes_body_id_type_and_headers() {
        let msg = Republish {
            queue: "orders".into(),
            body: vec![1, 2],
            content_type: Some("application/json".into()),
            headers: json!({"tenant": "acme", "bin": {"base64": "/wA="}, "n": 3, "body": "no"})
                .as_object()
                .cloned()
                .unwrap_or_default(),
            message_id: "order-7".into(),
            dedup_id: "d".into(),
            position: Json::Null,
        };
        let fields = publish_fields(&msg);
        let get = |n: &str| fields.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
        assert_eq!(get("body"), Some(vec![1, 2]));
        assert_eq!(get("message_id"), Some(b"order-7".to_vec()));
        assert_eq!(get("content_type"), Some(b"application/json".to_vec()));
        assert_eq!(get("tenant"), Some(b"acme".to_vec()));
        assert_eq!(get("bin"), Some(vec![0xff, 0x00]));
        assert_eq!(get("n"), Some(b"3".to_vec()));
        assert_eq!(fields.iter().filter(|(k, _)| k == "body").count(), 1);
    }

    #[test]
    fn replies_parse_in_both_protocols() {
        let entry = |id: &str| {
            Value::Array(vec![
                Value::BulkString(id.as_bytes().to_vec()),
                Value::Array(vec![
                    Value::BulkString(b"body".to_vec()),
                    Value::BulkString(b"x".to_vec()),
                ]),
            ])
        };
        let resp2 = Value::Array(vec![Value::Array(vec![
            Value::BulkString(b"s".to_vec()),
            Value::Array(vec![entry("1-0")]),
        ])]);
        let resp3 = Value::Map(vec![(
            Value::BulkString(b"s".to_vec()),
            Value::Array(vec![entry("1-0")]),
        )]);
        for v in [resp2, resp3] {
            let e = parse_read(v).unwrap_or_default();
            assert_eq!(e.len(), 1);
            assert_eq!(e[0].id, "1-0");
            assert_eq!(e[0].fields, vec![("body".to_owned(), b"x".to_vec())]);
        }
        assert_eq!(parse_read(Value::Nil), Ok(Vec::new()));

        let claimed = Value::Array(vec![
            Value::BulkString(b"0-0".to_vec()),
            Value::Array(vec![
                entry("2-0"),
                Value::Array(vec![Value::BulkString(b"3-0".to_vec()), Value::Nil]),
            ]),
            Value::Array(vec![]),
        ]);
        let (cursor, e) = parse_autoclaim(claimed).unwrap_or_default();
        assert_eq!(cursor, "0-0");
        assert_eq!(e.len(), 1, "a deleted entry is left out");

        let pending = Value::Array(vec![Value::Array(vec![
            Value::BulkString(b"2-0".to_vec()),
            Value::BulkString(b"c".to_vec()),
            Value::Int(1200),
            Value::Int(2),
        ])]);
        assert_eq!(parse_pending_count(&pending), Some(2));
        assert_eq!(parse_pending_count(&Value::Array(vec![])), None);
    }

    #[test]
    fn consumer_names_differ() {
        let a = consumer_name("lazaret");
        let b = consumer_name("lazaret");
        assert!(a.starts_with("lazaret-"), "{a}");
        assert_ne!(a, b);
    }
}
