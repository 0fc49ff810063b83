//! The RabbitMQ adapter (AMQP 0-9-1 through lapin, on tokio): consumes a
//! queue with manual acknowledgements and a prefetch of what the guard
//! holds unsettled ([`SourceSpec::unsettled_max`]), maps each delivery onto
//! [`Delivery`], publishes redrives with publisher confirms and
//! `mandatory`, and reads the `x-death` header of a dead-letter queue's
//! messages for watch mode. Acknowledgements that are ready together go
//! as one `basic.ack multiple=true` when nothing below them on the channel
//! is unsettled (`acks`).
//!
//! Only moves messages: what happens to one is the runtime's decision.

mod acks;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine;
use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions,
};
use lapin::publisher_confirm::Confirmation;
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use lazaret_core::{DeadLetterReason, Failure, Timestamp};
use serde_json::{Map, Number, Value, json};
use tokio::sync::{Mutex, oneshot};

use self::acks::{AckTracker, DeliveryTag};

use crate::broker::{Acker, Broker, BrokerError, Consumer, Incoming};
use crate::celery;
use crate::message::TakenIn;
use crate::message::{Delivery, Republish, bytes_value, content_id, header_text};
use crate::spec::SourceSpec;
use lazaret_core::mask_url;

/// The word in errors and dead letters.
const KIND: &str = "rabbitmq";

/// How long a publish waits for RabbitMQ's confirmation before the redrive
/// is reported as not confirmed (the dead letter then stays).
const CONFIRM_WAIT: Duration = Duration::from_secs(30);

/// How long connecting (TCP, AMQP handshake, login) may take.
const CONNECT_WAIT: Duration = Duration::from_secs(30);

/// The longest `ShortString` AMQP can carry (properties such as
/// `message_id` and `content_type` are short strings).
const SHORT_STRING_MAX: usize = 255;

/// Opens the adapter: connects now, so that a wrong URL or a broker that is
/// down shows at start, and keeps the connection (reopened by
/// [`Broker::consume`] and [`Broker::publish`] when it died).
pub async fn connect(spec: &SourceSpec) -> Result<Box<dyn Broker>, BrokerError> {
    let conn = open(spec).await?;
    Ok(Box::new(RabbitMq {
        spec: spec.clone(),
        conn: Mutex::new(conn),
        publisher: Mutex::new(None),
    }))
}

/// One source's RabbitMQ broker: a connection, and a channel in confirm
/// mode for redrives.
struct RabbitMq {
    spec: SourceSpec,
    conn: Mutex<Connection>,
    /// Kept between publishes so a redrive of many dead letters does not
    /// open a channel for each; replaced when it closed.
    publisher: Mutex<Option<Channel>>,
}

impl fmt::Debug for RabbitMq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitMq")
            .field("source", &self.spec.name)
            .field("url", &mask_url(&self.spec.url))
            .field("queue", &self.spec.queue)
            .finish_non_exhaustive()
    }
}

/// Connects to the source's URL, with lapin running on the current tokio
/// runtime rather than an executor of its own.
async fn open(spec: &SourceSpec) -> Result<Connection, BrokerError> {
    if spec
        .url
        .get(..8)
        .is_some_and(|s| s.eq_ignore_ascii_case("amqps://"))
    {
        // lapin is built without TLS (rustls would pull a C toolchain into
        // every build); say so rather than fail the handshake obscurely.
        return Err(BrokerError::Config(format!(
            "source {}: {} asks for TLS (amqps), which this build of lazaret does not \
             support yet; use amqp:// (e.g. through a local TLS tunnel)",
            spec.name,
            mask_url(&spec.url)
        )));
    }
    let props = ConnectionProperties::default()
        .with_connection_name(format!("lazaret source {}", spec.name).into())
        .with_executor(tokio_executor_trait::Tokio::current())
        .with_reactor(tokio_reactor_trait::Tokio::current());
    // A host that drops packets would otherwise hold the connection lock
    // (and every consume and publish behind it) for the OS's TCP timeout.
    match tokio::time::timeout(CONNECT_WAIT, Connection::connect(&spec.url, props)).await {
        Ok(Ok(conn)) => Ok(conn),
        Ok(Err(e)) => Err(connect_error(spec, &e)),
        Err(_) => Err(BrokerError::Connect {
            broker: KIND,
            url: mask_url(&spec.url),
            why: format!("no answer within {} s", CONNECT_WAIT.as_secs()),
        }),
    }
}

fn connect_error(spec: &SourceSpec, e: &lapin::Error) -> BrokerError {
    BrokerError::Connect {
        broker: KIND,
        url: mask_url(&spec.url),
        why: e.to_string(),
    }
}

fn op_error(op: impl Into<String>, e: &lapin::Error) -> BrokerError {
    BrokerError::Op {
        broker: KIND,
        op: op.into(),
        why: e.to_string(),
    }
}

impl RabbitMq {
    /// A new channel, on the kept connection or, when that one died, on a
    /// new one.
    async fn channel(&self) -> Result<Channel, BrokerError> {
        let mut conn = self.conn.lock().await;
        if !conn.status().connected() {
            tracing::info!(source = %self.spec.name, state = ?conn.status().state(),
                "the RabbitMQ connection is gone; reconnecting");
            *conn = open(&self.spec).await?;
        }
        match conn.create_channel().await {
            Ok(ch) => Ok(ch),
            Err(e) if conn.status().connected() => Err(op_error("open a channel", &e)),
            Err(e) => {
                // The connection died just now: open a new one rather than
                // fail this call. Channels still open on the old one (an
                // acknowledgement in flight) keep it until they are done.
                tracing::info!(source = %self.spec.name, "cannot open a channel ({e}); reconnecting");
                *conn = open(&self.spec).await?;
                conn.create_channel()
                    .await
                    .map_err(|e| connect_error(&self.spec, &e))
            }
        }
    }

    /// The channel redrives publish on, in confirm mode.
    async fn publisher(&self) -> Result<Channel, BrokerError> {
        let mut kept = self.publisher.lock().await;
        if let Some(ch) = kept.as_ref() {
            if ch.status().connected() {
                return Ok(ch.clone());
            }
        }
        let ch = self.channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(|e| op_error("confirm.select (publisher confirms)", &e))?;
        *kept = Some(ch.clone());
        Ok(ch)
    }

    async fn forget_publisher(&self) {
        *self.publisher.lock().await = None;
    }

    async fn open_consumer(&self) -> Result<Box<dyn Consumer>, BrokerError> {
        let queue = self.spec.queue.clone();
        let channel = self.channel().await?;
        // A prefetch of what the guard holds unsettled at most: `concurrency`
        // handler calls and `settling` more being written and acknowledged
        // (`SourceSpec::unsettled_max`; 16 × `concurrency` by default), so nothing
        // waits unacknowledged in a buffer.
        let prefetch = u16::try_from(self.spec.unsettled_max()).unwrap_or(u16::MAX);
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(|e| op_error(format!("basic.qos (prefetch {prefetch})"), &e))?;
        let consumer = channel
            .basic_consume(
                &queue,
                &format!("lazaret:{}", self.spec.name),
                BasicConsumeOptions {
                    no_ack: false,
                    ..BasicConsumeOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| BrokerError::Op {
                broker: KIND,
                op: format!("consume from queue {queue}"),
                why: format!("{e}; check that the queue exists on this virtual host"),
            })?;
        Ok(Box::new(RabbitConsumer {
            acks: Arc::new(Acks::new(channel.clone(), usize::from(prefetch))),
            channel,
            consumer,
            queue,
        }))
    }

    async fn publish_confirmed(&self, msg: Republish) -> Result<(), BrokerError> {
        let channel = self.publisher().await?;
        let not_confirmed = |why: String| BrokerError::NotConfirmed {
            broker: KIND,
            queue: msg.queue.clone(),
            why,
        };
        let mut props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_headers(json_to_table(&msg.headers));
        // A property is an AMQP short string; a longer id still travels in
        // `x-lazaret-message-id`, which wins when the message is consumed.
        if !msg.message_id.is_empty() && msg.message_id.len() <= SHORT_STRING_MAX {
            props = props.with_message_id(msg.message_id.as_str().into());
        }
        if let Some(ct) = msg.content_type.as_deref() {
            if ct.len() <= SHORT_STRING_MAX {
                props = props.with_content_type(ct.into());
            }
        }
        let published = channel
            .basic_publish(
                "",
                &msg.queue,
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                &msg.body,
                props,
            )
            .await;
        let confirm = match published {
            Ok(c) => c,
            Err(e) => {
                self.forget_publisher().await;
                return Err(op_error(format!("publish to queue {}", msg.queue), &e));
            }
        };
        let confirmation = match tokio::time::timeout(CONFIRM_WAIT, confirm).await {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                self.forget_publisher().await;
                return Err(not_confirmed(format!(
                    "the channel failed before RabbitMQ confirmed it: {e}"
                )));
            }
            Err(_) => {
                // The channel may be stuck: the next publish gets a new one.
                self.forget_publisher().await;
                return Err(not_confirmed(format!(
                    "no confirmation came within {} s",
                    CONFIRM_WAIT.as_secs()
                )));
            }
        };
        match confirmation {
            Confirmation::Ack(None) => Ok(()),
            Confirmation::Ack(Some(returned)) | Confirmation::Nack(Some(returned)) => {
                Err(not_confirmed(format!(
                    "RabbitMQ returned it as unroutable ({} {}): no queue of that name exists on \
                     this virtual host; declare it, or set the source's redrive_to",
                    returned.reply_code, returned.reply_text
                )))
            }
            Confirmation::Nack(None) => Err(not_confirmed(
                "RabbitMQ nacked it (the queue could not take it: check its length limit and \
                 the broker's logs)"
                    .into(),
            )),
            Confirmation::NotRequested => Err(not_confirmed(
                "the channel was not in confirm mode, so nothing says RabbitMQ has it".into(),
            )),
        }
    }
}

impl Broker for RabbitMq {
    fn kind(&self) -> &'static str {
        KIND
    }

    fn consume(&self) -> BoxFuture<'_, Result<Box<dyn Consumer>, BrokerError>> {
        Box::pin(self.open_consumer())
    }

    fn publish(&self, msg: Republish) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(self.publish_confirmed(msg))
    }

    /// No warnings: RabbitMQ does not expose a queue's arguments (such as a
    /// quorum queue's `x-delivery-limit`) over AMQP, nor can a policy that
    /// sets one be read there. Operators set `x-delivery-limit` above the
    /// type's `crash_loop_max` themselves (docs/brokers.md says so).
    fn check_limits(&self, attempts_max: u32) -> BoxFuture<'_, Vec<String>> {
        let _ = attempts_max;
        Box::pin(async { Vec::new() })
    }

    fn interpret<'a>(&'a self, d: &'a Delivery) -> BoxFuture<'a, Result<TakenIn, BrokerError>> {
        Box::pin(async move { Ok(dead_lettered(&d.headers)) })
    }

    /// Closes the connection (and so its channels: RabbitMQ requeues what
    /// was not acknowledged), waiting at most [`CLOSE_WAIT`].
    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            self.forget_publisher().await;
            let conn = self.conn.lock().await;
            if !conn.status().connected() {
                return;
            }
            match tokio::time::timeout(CLOSE_WAIT, conn.close(200, "lazaret is shutting down"))
                .await
            {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(source = %self.spec.name, "closing the RabbitMQ connection: {e}");
                }
                Err(_) => {
                    tracing::debug!(source = %self.spec.name, "RabbitMQ did not answer the close within {} s", CLOSE_WAIT.as_secs());
                }
            }
        })
    }
}

/// How long a close at shutdown waits for RabbitMQ's answer.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// A consumer on its own channel. The channel closes (and RabbitMQ requeues
/// what was not acknowledged) once the consumer and every acker of its
/// messages are gone.
struct RabbitConsumer {
    channel: Channel,
    consumer: lapin::Consumer,
    queue: String,
    acks: Arc<Acks>,
}

impl fmt::Debug for RabbitConsumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitConsumer")
            .field("queue", &self.queue)
            .field("channel", &self.channel.id())
            .finish_non_exhaustive()
    }
}

impl Consumer for RabbitConsumer {
    fn next(&mut self) -> BoxFuture<'_, Result<Option<Incoming>, BrokerError>> {
        Box::pin(async move {
            match self.consumer.next().await {
                None => Ok(None),
                Some(Err(e)) => Err(op_error(format!("consume from queue {}", self.queue), &e)),
                // Deliveries lapin buffered (the prefetch) outlive their
                // channel: once it is gone RabbitMQ has requeued them, and
                // an ack could only fail. Drop them with this consumer
                // rather than deliver each a second time.
                Some(Ok(_)) if !self.channel.status().connected() => Err(BrokerError::Op {
                    broker: KIND,
                    op: format!("consume from queue {}", self.queue),
                    why: format!(
                        "its channel closed ({:?}); RabbitMQ requeued the unacknowledged messages",
                        self.channel.status().state()
                    ),
                }),
                Some(Ok(d)) => {
                    self.acks.delivered(d.delivery_tag);
                    let ack = RabbitAcker {
                        acker: d.acker.clone(),
                        tag: d.delivery_tag,
                        acks: Arc::clone(&self.acks),
                    };
                    let delivery = to_delivery(
                        d.data,
                        &d.properties,
                        d.redelivered,
                        d.exchange.as_str(),
                        d.routing_key.as_str(),
                        &self.queue,
                    );
                    Ok(Some(Incoming {
                        delivery,
                        ack: Box::new(ack),
                    }))
                }
            }
        })
    }
}

/// The acknowledgements of one consumer's channel. Each `basic.ack` is a
/// frame RabbitMQ handles on its own, so acks that are ready together are
/// sent together: at most one batch is being sent per channel, and the
/// acks that become ready meanwhile make the next, planned by the
/// [`AckTracker`] (one `multiple=true` frame for the ready prefix of the
/// channel's unsettled tags). An ack above a tag that is not ready yet
/// waits for it to join the prefix: behind a delivery whose outcome is
/// decided and being written (a poison message's dead letter,
/// [`Acker::decided`]) until that write ends, for at most
/// [`ACK_HOLD_DECIDED`]; behind a handler still running for at most
/// [`ACK_HOLD`] and while fewer than `held_max` wait. Then each goes
/// alone. A lone ready ack at the bottom is sent at once.
struct Acks {
    /// Kept open while a consumer or acker of it lives: a delivery can only
    /// be acknowledged on the channel it came on.
    channel: Channel,
    state: std::sync::Mutex<AckState>,
    /// Wakes a sender waiting out a hold: an ack or a hand-back may have
    /// closed the gap.
    wake: tokio::sync::Notify,
    /// Held acks at most behind a handler still running (they keep their
    /// deliveries' settling slots); behind writes, as many as those slots.
    held_max: usize,
}

/// How long an ack above a gap waits for the gap to close while a handler
/// still runs below it: short against a handler's time, so a slow handler
/// below only delays the acks above it this much.
const ACK_HOLD: Duration = Duration::from_millis(2);
/// How long an ack above a gap waits when every gap below it is decided
/// and being written (a dead letter, a held retry): such a gap closes as
/// soon as its write is durable, so the acks above wait for it and go as
/// one frame; this bound only matters when the disk stalls.
const ACK_HOLD_DECIDED: Duration = Duration::from_millis(50);

type AckReply = oneshot::Sender<Result<(), String>>;

#[derive(Default)]
struct AckState {
    tracker: AckTracker,
    /// Who waits for each ready tag's frame to be sent.
    waiters: HashMap<DeliveryTag, AckReply>,
    /// A task is sending; it plans again until nothing is ready.
    sending: bool,
    /// Since when acks above a gap have been held.
    held_since: Option<tokio::time::Instant>,
}

impl Acks {
    fn new(channel: Channel, unsettled_max: usize) -> Acks {
        Acks {
            channel,
            state: std::sync::Mutex::new(AckState::default()),
            wake: tokio::sync::Notify::new(),
            // Half the prefetch, behind a running handler (behind a write
            // the settling slots bound them). With a quarter of a prefetch
            // of 32, a 10% poison mix at ~15,000 msg/s still sent most acks
            // alone (14,200 frames for 20,000 messages); with half, 4,700,
            // as many as without poison. Waiting out the dead letters'
            // writes (prefetch 128) cut it to ~3,000 for 40,000.
            held_max: (unsettled_max / 2).max(1),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, AckState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn delivered(&self, tag: DeliveryTag) {
        self.lock().tracker.delivered(tag);
    }

    /// Acknowledges `tag`; answers once the frame that covers it is sent.
    async fn ack(self: Arc<Self>, tag: DeliveryTag) -> Result<(), BrokerError> {
        let failed = |why: String| BrokerError::Op {
            broker: KIND,
            op: "basic.ack".into(),
            why,
        };
        let (reply, answer) = oneshot::channel();
        let start = {
            let mut state = self.lock();
            if !state.tracker.ready(tag) {
                return Err(failed(format!(
                    "delivery tag {tag} is settled already on this channel"
                )));
            }
            state.waiters.insert(tag, reply);
            !std::mem::replace(&mut state.sending, true)
        };
        if start {
            // A task of its own, so that a waiter dropped (shutdown) never
            // strands the others.
            tokio::spawn(Arc::clone(&self).send_all());
        } else {
            self.wake.notify_one();
        }
        match answer.await {
            Ok(r) => r.map_err(failed),
            Err(_) => Err(failed(
                "it was not sent; RabbitMQ redelivers the message".into(),
            )),
        }
    }

    /// Sends what is ready, plan after plan, until nothing is; then the
    /// next ack starts a new task. Acks above a gap are held (see
    /// [`Acks`]): the task waits for the gap to close or the hold to end.
    async fn send_all(self: Arc<Self>) {
        loop {
            let planned: Result<Vec<_>, tokio::time::Instant> = {
                let mut state = self.lock();
                let now = tokio::time::Instant::now();
                // Behind a delivery being written, acks wait for its write
                // (bounded by the settling slots they keep); behind a
                // handler still running, only briefly and only so many.
                let decided = state.tracker.blocked_by_decided();
                let hold = if decided { ACK_HOLD_DECIDED } else { ACK_HOLD };
                let flush = (!decided && state.tracker.held() >= self.held_max)
                    || state.held_since.is_some_and(|t| now >= t + hold);
                let frames = if flush {
                    state.tracker.take_frames()
                } else {
                    state.tracker.take_prefix()
                };
                // The hold counts from the last time the prefix moved: the
                // gap that blocks it now may be another.
                state.held_since = match state.tracker.held() {
                    0 => None,
                    _ if !frames.is_empty() => Some(now),
                    _ => Some(state.held_since.unwrap_or(now)),
                };
                if frames.is_empty() {
                    let Some(since) = state.held_since else {
                        state.sending = false;
                        return;
                    };
                    Err(since + hold)
                } else {
                    Ok(frames
                        .into_iter()
                        .map(|f| {
                            let waiters: Vec<AckReply> = f
                                .covers
                                .iter()
                                .filter_map(|t| state.waiters.remove(t))
                                .collect();
                            (f, waiters)
                        })
                        .collect())
                }
            };
            let planned = match planned {
                Ok(planned) => planned,
                Err(until) => {
                    tokio::select! {
                        () = tokio::time::sleep_until(until) => {}
                        () = self.wake.notified() => {}
                    }
                    continue;
                }
            };
            // A plan's frames cover disjoint tags: sent together, and all
            // before the next plan's (a tag acked twice closes the channel).
            let sent = futures_util::future::join_all(planned.iter().map(|(f, _)| {
                self.channel.basic_ack(
                    f.tag,
                    BasicAckOptions {
                        multiple: f.multiple,
                    },
                )
            }))
            .await;
            for ((_, waiters), r) in planned.into_iter().zip(sent) {
                let r = r.map_err(|e| format!("{e}; RabbitMQ redelivers the message"));
                for w in waiters {
                    let _ = w.send(r.clone());
                }
            }
        }
    }

    /// `tag`'s outcome is decided and being written: acks above it wait
    /// for it ([`ACK_HOLD_DECIDED`]) rather than go alone.
    fn decided(&self, tag: DeliveryTag) {
        self.lock().tracker.decided(tag);
    }

    /// `tag`'s hand-back was sent: acks above it may now cover its place.
    fn handed_back(&self, tag: DeliveryTag) {
        self.lock().tracker.handed_back(tag);
        self.wake.notify_one();
    }
}

/// Settles one delivery, through its channel's [`Acks`].
struct RabbitAcker {
    acker: lapin::acker::Acker,
    tag: DeliveryTag,
    acks: Arc<Acks>,
}

impl fmt::Debug for RabbitAcker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RabbitAcker")
            .field("tag", &self.tag)
            .finish_non_exhaustive()
    }
}

/// lapin answers `false` when it did not send the acknowledgement because
/// the channel is gone; RabbitMQ then redelivers the message.
fn sent(op: &str, r: Result<bool, lapin::Error>) -> Result<(), BrokerError> {
    match r {
        Ok(true) => Ok(()),
        Ok(false) => Err(BrokerError::Op {
            broker: KIND,
            op: op.into(),
            why: "the channel closed first; RabbitMQ redelivers the message".into(),
        }),
        Err(e) => Err(op_error(op, &e)),
    }
}

impl Acker for RabbitAcker {
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), BrokerError>> {
        Box::pin(async move { Arc::clone(&self.acks).ack(self.tag).await })
    }

    fn decided(&self) {
        self.acks.decided(self.tag);
    }

    /// The channel it came on is open: a delivery tag means nothing on
    /// another channel, and RabbitMQ requeued it when this one closed.
    fn live(&self) -> bool {
        self.acks.channel.status().connected()
    }

    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), BrokerError>> {
        Box::pin(async move {
            let r = self
                .acker
                .nack(BasicNackOptions {
                    multiple: false,
                    requeue: true,
                })
                .await;
            if matches!(r, Ok(true)) {
                // Only once RabbitMQ has the nack may an ack above cover
                // the tag: until then it still holds the message for us.
                self.acks.handed_back(self.tag);
            }
            sent("basic.nack (requeue)", r)
        })
    }
}

/// A RabbitMQ delivery as the gates see it (the contract's table): the
/// `message_id` property, else Celery's `id` header, else a hash of body
/// and headers; the quorum queue's `x-delivery-count` as the earlier
/// deliveries, or for a classic queue 1 when it is redelivered.
pub fn to_delivery(
    body: Vec<u8>,
    props: &BasicProperties,
    redelivered: bool,
    exchange: &str,
    routing_key: &str,
    queue: &str,
) -> Delivery {
    let headers = props
        .headers()
        .as_ref()
        .map(table_to_json)
        .unwrap_or_default();
    let message_id = props
        .message_id()
        .as_ref()
        .map(|id| id.as_str().to_owned())
        .filter(|id| !id.is_empty())
        .or_else(|| celery::Task::recognise(&headers).map(|t| t.id))
        .unwrap_or_else(|| content_id(&body, &headers));
    let delivery_count = headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("x-delivery-count"))
        .and_then(|(_, v)| header_text(v))
        .and_then(|n| n.parse::<u64>().ok());
    let broker_prior = match delivery_count {
        Some(n) => u32::try_from(n).unwrap_or(u32::MAX),
        None => u32::from(redelivered),
    };
    Delivery {
        message_id,
        body,
        content_type: props.content_type().as_ref().map(|c| c.as_str().to_owned()),
        headers,
        broker_prior,
        redelivered,
        queue: queue.to_owned(),
        position: json!({"exchange": exchange, "routing_key": routing_key}),
    }
}

/// An AMQP headers table as JSON: nested tables and arrays recursively,
/// strings that are not UTF-8 and byte arrays as `{"base64": …}`,
/// timestamps as seconds since the epoch.
pub fn table_to_json(t: &FieldTable) -> Map<String, Value> {
    t.inner()
        .iter()
        .map(|(k, v)| (k.as_str().to_owned(), amqp_to_json(v)))
        .collect()
}

fn float(f: f64) -> Value {
    // JSON has no NaN or infinity: keep them readable as text.
    Number::from_f64(f).map_or_else(|| Value::String(f.to_string()), Value::Number)
}

fn amqp_to_json(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::Boolean(b) => Value::Bool(*b),
        AMQPValue::ShortShortInt(n) => json!(n),
        AMQPValue::ShortShortUInt(n) => json!(n),
        AMQPValue::ShortInt(n) => json!(n),
        AMQPValue::ShortUInt(n) => json!(n),
        AMQPValue::LongInt(n) => json!(n),
        AMQPValue::LongUInt(n) => json!(n),
        AMQPValue::LongLongInt(n) => json!(n),
        AMQPValue::Timestamp(n) => json!(n),
        AMQPValue::Float(f) => float(f64::from(*f)),
        AMQPValue::Double(f) => float(*f),
        AMQPValue::DecimalValue(d) => float(f64::from(d.value) / 10f64.powi(i32::from(d.scale))),
        AMQPValue::ShortString(s) => Value::String(s.as_str().to_owned()),
        AMQPValue::LongString(s) => bytes_value(s.as_bytes()),
        AMQPValue::ByteArray(b) => bytes_value(b.as_slice()),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(amqp_to_json).collect()),
        AMQPValue::FieldTable(t) => Value::Object(table_to_json(t)),
        AMQPValue::Void => Value::Null,
    }
}

/// JSON headers as an AMQP table, for a republish: strings as long
/// strings, integers as long long ints, floats as doubles, objects as
/// tables, arrays as arrays, and `{"base64": …}` as a byte array.
pub fn json_to_table(m: &Map<String, Value>) -> FieldTable {
    let mut t = FieldTable::default();
    for (k, v) in m {
        t.insert(ShortString::from(k.as_str()), json_to_amqp(v));
    }
    t
}

fn json_to_amqp(v: &Value) -> AMQPValue {
    match v {
        Value::Null => AMQPValue::Void,
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => AMQPValue::LongLongInt(i),
            // Above i64::MAX: AMQP's only unsigned 64-bit type is a timestamp.
            (None, Some(u)) => AMQPValue::Timestamp(u),
            _ => AMQPValue::Double(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => AMQPValue::LongString(LongString::from(s.as_str())),
        Value::Array(a) => AMQPValue::FieldArray(FieldArray::from(
            a.iter().map(json_to_amqp).collect::<Vec<_>>(),
        )),
        Value::Object(o) => {
            let base64 = (o.len() == 1)
                .then(|| o.get("base64").and_then(Value::as_str))
                .flatten()
                .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok());
            match base64 {
                Some(bytes) => AMQPValue::ByteArray(bytes.into()),
                None => AMQPValue::FieldTable(json_to_table(o)),
            }
        }
    }
}

/// One entry of `x-death`.
#[derive(Clone, Debug, PartialEq)]
struct Death {
    queue: Option<String>,
    reason: Option<String>,
    count: u32,
    exchange: Option<String>,
    routing_keys: Vec<Value>,
    time: Option<i64>,
}

fn death(v: &Value) -> Option<Death> {
    let t = v.as_object()?;
    let text = |k: &str| t.get(k).and_then(header_text).filter(|s| !s.is_empty());
    Some(Death {
        queue: text("queue"),
        reason: text("reason"),
        count: text("count")
            .and_then(|c| c.parse::<u64>().ok())
            .map_or(1, |c| u32::try_from(c).unwrap_or(u32::MAX)),
        exchange: t.get("exchange").and_then(header_text),
        routing_keys: match t.get("routing-keys") {
            Some(Value::Array(keys)) => keys.clone(),
            Some(other) => vec![other.clone()],
            None => Vec::new(),
        },
        time: text("time").and_then(|s| s.parse::<i64>().ok()),
    })
}

fn reason_of(word: &str) -> DeadLetterReason {
    match word {
        "expired" => DeadLetterReason::Expired,
        "maxlen" => DeadLetterReason::Maxlen,
        "delivery_limit" => DeadLetterReason::DeliveryLimit,
        // `rejected`, and any reason a later RabbitMQ may add.
        _ => DeadLetterReason::Rejected,
    }
}

/// What a message of a RabbitMQ dead-letter queue says of itself, from its
/// headers: `x-death` (an array of tables, newest first: `count`, `reason`,
/// `queue`, `exchange`, `routing-keys`, `time`) and `x-first-death-queue`,
/// `-reason`, `-exchange`.
///
/// The reason and count are the newest death's (why it is here now); the
/// original queue, coordinates and time are the first death's (where it
/// came from, and where a redrive sends it back). A message without
/// `x-death` was not dead-lettered by RabbitMQ: only what the
/// `x-first-death-*` headers say, if anything, is taken.
pub fn dead_lettered(headers: &Map<String, Value>) -> TakenIn {
    let header = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v)
    };
    let text = |name: &str| header(name).and_then(header_text).filter(|s| !s.is_empty());
    let deaths: Vec<Death> = match header("x-death") {
        Some(Value::Array(entries)) => entries.iter().filter_map(death).collect(),
        _ => Vec::new(),
    };
    let first_queue = text("x-first-death-queue");
    let first_reason = text("x-first-death-reason");
    let Some(newest) = deaths.first() else {
        return TakenIn {
            reason: first_reason.as_deref().map(reason_of),
            original_queue: first_queue,
            ..TakenIn::default()
        };
    };
    // The first death is the entry for x-first-death-queue (and its reason),
    // else the oldest one.
    let first = first_queue
        .as_ref()
        .and_then(|q| {
            deaths.iter().rev().find(|d| {
                d.queue.as_ref() == Some(q)
                    && first_reason
                        .as_ref()
                        .is_none_or(|r| d.reason.as_ref() == Some(r))
            })
        })
        .or(deaths.last())
        .unwrap_or(newest);
    let word = newest.reason.clone().unwrap_or_else(|| "rejected".into());
    let times = match newest.count {
        1 => "once".to_owned(),
        n => format!("{n} times"),
    };
    let from = newest
        .queue
        .as_deref()
        .map_or_else(|| "a queue".to_owned(), |q| format!("queue {q}"));
    let original_queue = first_queue.or_else(|| first.queue.clone());
    let exchange = text("x-first-death-exchange")
        .or_else(|| first.exchange.clone())
        .unwrap_or_default();
    TakenIn {
        reason: Some(reason_of(&word)),
        error: Some(Failure::new(
            word.as_str(),
            format!("RabbitMQ dead-lettered it from {from} ({word}, {times})"),
        )),
        original_queue,
        original_position: Some(json!({
            "exchange": exchange,
            "routing_keys": first.routing_keys,
        })),
        attempts: newest.count,
        first_at: first
            .time
            .map(|s| Timestamp::from_millis(s.saturating_mul(1000))),
        original: None,
    }
}

#[cfg(test)]
mod tests {
    use lapin::types::{ByteArray, DecimalValue};

    use super::*;

    fn map(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn one_rejection_names_its_queue_reason_and_time() {
        let h = map(json!({
            "x-death": [{
                "count": 1, "reason": "rejected", "queue": "orders", "time": 1_700_000_000,
                "exchange": "", "routing-keys": ["orders"]
            }],
            "x-first-death-queue": "orders",
            "x-first-death-reason": "rejected",
            "x-first-death-exchange": ""
        }));
        let t = dead_lettered(&h);
        assert_eq!(t.reason, Some(DeadLetterReason::Rejected));
        assert_eq!(t.original_queue.as_deref(), Some("orders"));
        assert_eq!(t.attempts, 1);
        assert_eq!(t.first_at, Some(Timestamp::from_millis(1_700_000_000_000)));
        assert_eq!(
            t.original_position,
            Some(json!({"exchange": "", "routing_keys": ["orders"]}))
        );
        let e = t.error.unwrap_or_else(|| Failure::new("none", ""));
        assert_eq!(e.kind.to_string(), "rejected");
        assert_eq!(
            e.message,
            "RabbitMQ dead-lettered it from queue orders (rejected, once)"
        );
        assert_eq!(t.original, None);
    }

    #[test]
    fn each_reason_word_has_its_reason() {
        for (word, reason) in [
            ("rejected", DeadLetterReason::Rejected),
            ("expired", DeadLetterReason::Expired),
            ("maxlen", DeadLetterReason::Maxlen),
            ("delivery_limit", DeadLetterReason::DeliveryLimit),
            ("something_new", DeadLetterReason::Rejected),
        ] {
            let h = map(json!({"x-death": [{"count": 3, "reason": word, "queue": "orders"}]}));
            let t = dead_lettered(&h);
            assert_eq!(t.reason, Some(reason), "{word}");
            assert_eq!(t.attempts, 3);
            assert_eq!(
                t.error.map(|e| e.message),
                Some(format!(
                    "RabbitMQ dead-lettered it from queue orders ({word}, 3 times)"
                ))
            );
        }
    }

    #[test]
    fn the_newest_death_gives_the_reason_and_the_first_the_origin() {
        // A retry loop through a wait queue: rejected from `work`, expired
        // from `work.wait` back into `work`, then delivery_limit from `work`.
        let h = map(json!({
            "x-death": [
                {"count": 2, "reason": "delivery_limit", "queue": "work", "time": 300,
                 "exchange": "jobs", "routing-keys": ["work.run"]},
                {"count": 2, "reason": "expired", "queue": "work.wait", "time": 200,
                 "exchange": "", "routing-keys": ["work.wait"]},
                {"count": 2, "reason": "rejected", "queue": "work", "time": 100,
                 "exchange": "jobs", "routing-keys": ["work.run"]}
            ],
            "x-first-death-queue": "work",
            "x-first-death-reason": "rejected",
            "x-first-death-exchange": "jobs"
        }));
        let t = dead_lettered(&h);
        assert_eq!(t.reason, Some(DeadLetterReason::DeliveryLimit));
        assert_eq!(t.attempts, 2);
        assert_eq!(t.original_queue.as_deref(), Some("work"));
        assert_eq!(t.first_at, Some(Timestamp::from_millis(100_000)));
        assert_eq!(
            t.original_position,
            Some(json!({"exchange": "jobs", "routing_keys": ["work.run"]}))
        );
    }

    #[test]
    fn without_x_death_only_the_first_death_headers_count() {
        let t = dead_lettered(&Map::new());
        assert_eq!(t, TakenIn::default());
        let t = dead_lettered(&map(
            json!({"x-first-death-queue": "q", "x-first-death-reason": "expired"}),
        ));
        assert_eq!(t.original_queue.as_deref(), Some("q"));
        assert_eq!(t.reason, Some(DeadLetterReason::Expired));
        assert_eq!(t.error, None);
    }

    #[test]
    fn a_garbled_x_death_is_read_as_far_as_it_goes() {
        let t = dead_lettered(&map(json!({"x-death": [{"queue": "q"}, 7]})));
        assert_eq!(t.reason, Some(DeadLetterReason::Rejected));
        assert_eq!(t.attempts, 1);
        assert_eq!(t.original_queue.as_deref(), Some("q"));
        assert_eq!(t.first_at, None);
    }

    #[test]
    fn headers_convert_to_json_and_back() {
        let mut inner = FieldTable::default();
        inner.insert("n".into(), AMQPValue::LongInt(-4));
        let mut t = FieldTable::default();
        t.insert("s".into(), AMQPValue::LongString("text".into()));
        t.insert("raw".into(), AMQPValue::LongString(vec![0xff, 0x00].into()));
        t.insert(
            "bytes".into(),
            AMQPValue::ByteArray(ByteArray::from(vec![1u8, 0xfe])),
        );
        t.insert("b".into(), AMQPValue::Boolean(true));
        t.insert("i".into(), AMQPValue::LongLongInt(7));
        t.insert("f".into(), AMQPValue::Double(1.5));
        t.insert("t".into(), AMQPValue::Timestamp(1_700_000_000));
        t.insert(
            "d".into(),
            AMQPValue::DecimalValue(DecimalValue {
                scale: 2,
                value: 150,
            }),
        );
        t.insert("v".into(), AMQPValue::Void);
        t.insert("table".into(), AMQPValue::FieldTable(inner));
        t.insert(
            "array".into(),
            AMQPValue::FieldArray(
                vec![AMQPValue::ShortString("a".into()), AMQPValue::ShortInt(2)].into(),
            ),
        );
        let j = table_to_json(&t);
        assert_eq!(
            Value::Object(j.clone()),
            json!({
                "s": "text", "raw": {"base64": "/wA="}, "bytes": {"base64": "Af4="},
                "b": true, "i": 7, "f": 1.5, "t": 1_700_000_000, "d": 1.5, "v": null,
                "table": {"n": -4}, "array": ["a", 2]
            })
        );
        let back = json_to_table(&j);
        let get = |k: &str| back.inner().get(k).cloned();
        assert_eq!(get("s"), Some(AMQPValue::LongString("text".into())));
        assert_eq!(
            get("raw"),
            Some(AMQPValue::ByteArray(vec![0xff, 0x00].into()))
        );
        assert_eq!(get("i"), Some(AMQPValue::LongLongInt(7)));
        assert_eq!(get("f"), Some(AMQPValue::Double(1.5)));
        assert_eq!(get("b"), Some(AMQPValue::Boolean(true)));
        assert_eq!(get("v"), Some(AMQPValue::Void));
        let mut n = FieldTable::default();
        n.insert("n".into(), AMQPValue::LongLongInt(-4));
        assert_eq!(get("table"), Some(AMQPValue::FieldTable(n)));
        assert_eq!(
            get("array"),
            Some(AMQPValue::FieldArray(
                vec![AMQPValue::LongString("a".into()), AMQPValue::LongLongInt(2)].into()
            ))
        );
        // And once more round: JSON is stable after the first conversion.
        assert_eq!(table_to_json(&back), j);
    }

    #[test]
    fn the_id_is_the_property_else_celerys_else_a_hash() {
        let mut h = FieldTable::default();
        h.insert("task".into(), AMQPValue::LongString("tasks.add".into()));
        h.insert("id".into(), AMQPValue::LongString("c-1".into()));
        let props = BasicProperties::default().with_headers(h.clone());
        let d = to_delivery(b"x".to_vec(), &props, false, "", "q", "q");
        assert_eq!(d.message_id, "c-1");
        assert_eq!(d.broker_prior, 0);
        assert_eq!(d.position, json!({"exchange": "", "routing_key": "q"}));

        let props = props.with_message_id("m-1".into());
        assert_eq!(
            to_delivery(b"x".to_vec(), &props, false, "", "q", "q").message_id,
            "m-1"
        );

        let plain = BasicProperties::default().with_content_type("text/plain".into());
        let d = to_delivery(b"x".to_vec(), &plain, true, "ex", "rk", "q");
        assert!(d.message_id.starts_with("sha256:"));
        assert_eq!(d.content_type.as_deref(), Some("text/plain"));
        // A classic queue's redelivery counts one earlier delivery.
        assert_eq!(d.broker_prior, 1);
        assert!(d.redelivered);
    }

    #[test]
    fn a_quorum_delivery_count_is_the_earlier_deliveries() {
        let mut h = FieldTable::default();
        h.insert("x-delivery-count".into(), AMQPValue::LongLongInt(3));
        let props = BasicProperties::default().with_headers(h);
        assert_eq!(
            to_delivery(vec![], &props, true, "", "q", "q").broker_prior,
            3
        );
    }
}
