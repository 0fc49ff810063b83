//! The NATS JetStream adapter: a source's `queue` is a stream, its `group`
//! a durable pull consumer on it.
//!
//! - **Guard.** Messages are pulled in batches no larger than the
//!   deliveries the runtime can still start, acknowledged with a double ack
//!   (the server confirms it), kept from redelivery with in-progress acks
//!   while their handler runs, and handed back with a `-NAK`.
//! - **Redrive.** A publish with headers and a fresh `Nats-Msg-Id`, done
//!   when the stream's PubAck came back (not a duplicate).
//! - **Watch.** A stream holding dead messages is, in practice, one that
//!   captures JetStream's advisories
//!   `$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>` and
//!   `…MSG_TERMINATED…`: each advisory is turned back into the message it
//!   names (fetched from its stream by sequence). Any other message is a
//!   copied dead message, taken as it is.

use std::collections::VecDeque;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::consumer::pull;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::stream::RawMessageErrorKind;
use async_nats::jetstream::{self, AckKind};
use async_nats::{HeaderName, HeaderValue, Subject};
use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use lazaret_core::{DeadLetterReason, Failure, Timestamp};
use serde_json::{Map, Value, json};

use crate::broker::{Acker, Broker, BrokerError, Consumer, Incoming};
use crate::message::TakenIn;
use crate::message::{Delivery, header_text, value_bytes};
use crate::spec::SourceSpec;
use lazaret_core::mask_url;

const BROKER: &str = "nats";

/// JetStream's message id header: the id of a message (the contract's
/// table) and its deduplication key.
const MSG_ID: &str = "Nats-Msg-Id";
/// A copied dead message names its broker reason here (`rejected`,
/// `max_deliveries`, …).
const REASON_HEADER: &str = "Lazaret-Reason";
/// A copied dead message names the stream it came from here.
const ORIGINAL_STREAM_HEADER: &str = "Lazaret-Original-Stream";

/// The advisory JetStream publishes when a consumer's `MaxDeliver` is
/// reached.
const MAX_DELIVER_TYPE: &str = "io.nats.jetstream.advisory.v1.max_deliver";
/// The advisory JetStream publishes when a consumer terminates a message
/// (`+TERM`).
const TERMINATED_TYPE: &str = "io.nats.jetstream.advisory.v1.terminated";

/// How long one pull request waits on the server for a first message.
/// Short: the last pull of a consumer closed at shutdown runs on for this
/// long (what it still brings is handed back with a `-NAK`).
const PULL_WAIT: Duration = Duration::from_secs(2);
/// Added to the source's delivery timeout for the consumer's ack wait: a
/// running delivery is kept alive by in-progress acks anyway; the margin
/// covers lazaret's own store write and acknowledgement after it. It is
/// also how long a message waits for redelivery after lazaret died with it.
const ACK_WAIT_MARGIN: Duration = Duration::from_secs(5);

/// Opens the adapter: a connection and a JetStream context on it.
pub async fn connect(spec: &SourceSpec) -> Result<Box<dyn Broker>, BrokerError> {
    let client =
        async_nats::connect(spec.url.as_str())
            .await
            .map_err(|e| BrokerError::Connect {
                broker: BROKER,
                url: mask_url(&spec.url),
                why: e.to_string(),
            })?;
    Ok(Box::new(Nats {
        spec: spec.clone(),
        js: jetstream::new(client),
    }))
}

/// A source's JetStream: its stream, its durable consumer, and the
/// context the redrive publishes through.
struct Nats {
    spec: SourceSpec,
    js: jetstream::Context,
}

impl fmt::Debug for Nats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Nats")
            .field("source", &self.spec.name)
            .field("stream", &self.spec.queue)
            .field("consumer", &self.spec.group)
            .finish_non_exhaustive()
    }
}

fn op(what: impl Into<String>) -> impl FnOnce(&dyn fmt::Display) -> BrokerError {
    let what = what.into();
    move |e| BrokerError::Op {
        broker: BROKER,
        op: what,
        why: e.to_string(),
    }
}

impl Nats {
    /// The stream of the source, or what to do about it missing.
    async fn stream(&self) -> Result<jetstream::stream::Stream, BrokerError> {
        let name = &self.spec.queue;
        match self.js.get_stream(name).await {
            Ok(s) => Ok(s),
            Err(e) => match e.kind() {
                jetstream::context::GetStreamErrorKind::JetStream(j)
                    if j.error_code() == ErrorCode::STREAM_NOT_FOUND =>
                {
                    Err(BrokerError::Config(format!(
                        "source {}: JetStream has no stream {name:?}; create it (nats stream add {name} --subjects …) or set the source's queue to an existing stream",
                        self.spec.name
                    )))
                }
                jetstream::context::GetStreamErrorKind::InvalidStreamName
                | jetstream::context::GetStreamErrorKind::EmptyName => {
                    Err(BrokerError::Config(format!(
                        "source {}: {name:?} is not a valid JetStream stream name (no '.', '*', '>' or spaces); the queue of a nats source is the stream, not a subject",
                        self.spec.name
                    )))
                }
                _ => Err(op(format!("look up stream {name}"))(&e)),
            },
        }
    }

    /// The durable pull consumer, created when missing.
    async fn pull_consumer(&self) -> Result<PullConsumer, BrokerError> {
        let stream = self.stream().await?;
        let group = &self.spec.group;
        let config = pull::Config {
            durable_name: Some(group.clone()),
            description: Some(format!("lazaret source {}", self.spec.name)),
            ack_policy: AckPolicy::Explicit,
            ack_wait: self.spec.delivery_timeout + ACK_WAIT_MARGIN,
            // lazaret counts attempts and dead-letters itself; a MaxDeliver
            // would only count crashes, and stop delivering silently.
            max_deliver: -1,
            deliver_policy: DeliverPolicy::All,
            max_ack_pending: i64::from(self.spec.concurrency).max(1000),
            ..Default::default()
        };
        let consumer = stream
            .get_or_create_consumer::<pull::Config>(group, config)
            .await
            .map_err(|e| match e.kind() {
                jetstream::stream::ConsumerErrorKind::InvalidConsumerType => {
                    BrokerError::Config(format!(
                        "source {}: consumer {group:?} of stream {} is a push consumer; lazaret needs a pull consumer: set the source's group to another name (lazaret creates it) or delete that consumer",
                        self.spec.name, self.spec.queue
                    ))
                }
                _ => op(format!(
                    "get or create consumer {group} on stream {}",
                    self.spec.queue
                ))(&e),
            })?;
        let config = &consumer.cached_info().config;
        if config.ack_policy != AckPolicy::Explicit {
            return Err(BrokerError::Config(format!(
                "source {}: consumer {group:?} of stream {} acknowledges {:?}, but lazaret settles each message on its own: use a consumer with explicit acks (set the source's group to a new name and lazaret creates one)",
                self.spec.name, self.spec.queue, config.ack_policy
            )));
        }
        Ok(consumer)
    }

    /// Where a redrive of `msg` goes: a subject.
    ///
    /// `msg.queue` is a stream name (the source's stream, a watch's
    /// original stream, or `redrive_to` naming one) or else a subject
    /// (`redrive_to` naming one). For a stream, the message's own subject
    /// (`position.subject`) when the stream captures it, else the stream's
    /// only subject.
    async fn subject_for(&self, msg: &crate::message::Republish) -> Result<String, BrokerError> {
        let queue = msg.queue.as_str();
        let original = msg.position.get("subject").and_then(Value::as_str);
        if !is_stream_name(queue) {
            return Ok(queue.to_owned());
        }
        let subjects = match self.js.get_stream(queue).await {
            Ok(s) => s.cached_info().config.subjects.clone(),
            Err(e) => match e.kind() {
                jetstream::context::GetStreamErrorKind::JetStream(j)
                    if j.error_code() == ErrorCode::STREAM_NOT_FOUND =>
                {
                    // No stream of that name: it is a subject.
                    return Ok(queue.to_owned());
                }
                _ => return Err(op(format!("look up stream {queue}"))(&e)),
            },
        };
        pick_subject(queue, &subjects, original)
            .map(str::to_owned)
            .map_err(BrokerError::Config)
    }
}

/// A stream name JetStream accepts (no `.`, `*`, `>` or whitespace), so
/// possibly a stream rather than a subject.
fn is_stream_name(s: &str) -> bool {
    !s.is_empty()
        && !s
            .chars()
            .any(|c| c == '.' || c == '*' || c == '>' || c.is_whitespace())
}

/// The subject to publish to for a stream with `subjects`: the original
/// subject when the stream captures it, else the stream's only literal
/// subject.
fn pick_subject<'a>(
    stream: &str,
    subjects: &'a [String],
    original: Option<&'a str>,
) -> Result<&'a str, String> {
    if let Some(subject) = original {
        if subjects.iter().any(|f| subject_matches(f, subject)) {
            return Ok(subject);
        }
    }
    match subjects {
        [only] if !only.contains(['*', '>']) => Ok(only),
        _ => Err(format!(
            "cannot tell which subject of stream {stream} to republish to: it captures {subjects:?}; set the source's redrive_to to a subject the stream captures (e.g. \"{}\")",
            subjects
                .first()
                .map_or("orders.retry", |s| s.as_str())
                .replace(['*', '>'], "retry")
        )),
    }
}

/// Whether the subject filter `filter` (`*` one token, `>` the rest)
/// matches `subject`.
fn subject_matches(filter: &str, subject: &str) -> bool {
    let mut f = filter.split('.');
    let mut s = subject.split('.');
    loop {
        match (f.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

impl Broker for Nats {
    fn kind(&self) -> &'static str {
        BROKER
    }

    fn consume(&self) -> BoxFuture<'_, Result<Box<dyn Consumer>, BrokerError>> {
        Box::pin(async move {
            let consumer = self.pull_consumer().await?;
            let ack_wait = consumer.cached_info().config.ack_wait;
            let held: Arc<Mutex<Held>> = Arc::default();
            let keepalive = tokio::spawn(keep_alive(
                self.js.client(),
                Arc::downgrade(&held),
                (ack_wait / 3).clamp(Duration::from_millis(100), Duration::from_secs(10)),
            ));
            Ok(Box::new(Pull {
                js: self.js.clone(),
                consumer,
                stream: self.spec.queue.clone(),
                limit: self.spec.concurrency.max(1) as usize,
                held,
                outstanding: Arc::new(AtomicUsize::new(0)),
                keepalive,
                pulling: None,
            }) as Box<dyn Consumer>)
        })
    }

    fn publish(&self, msg: crate::message::Republish) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(async move {
            let subject = self.subject_for(&msg).await?;
            let mut headers = to_nats_headers(&msg.headers).map_err(|e| {
                BrokerError::Config(format!(
                    "cannot republish message {} to {subject}: {e}",
                    msg.message_id
                ))
            })?;
            if let Some(ct) = &msg.content_type {
                if !msg
                    .headers
                    .keys()
                    .any(|k| k.eq_ignore_ascii_case("content-type"))
                {
                    if let Ok(v) = ct.parse::<HeaderValue>() {
                        headers.insert("Content-Type", v);
                    }
                }
            }
            // A fresh id: the duplicate window would drop the original's.
            headers.insert(MSG_ID, msg.dedup_id.as_str());
            let not_confirmed = |why: String| BrokerError::NotConfirmed {
                broker: BROKER,
                queue: subject.clone(),
                why,
            };
            let ack = self
                .js
                .publish_with_headers(subject.clone(), headers, msg.body.into())
                .await
                .map_err(|e| not_confirmed(e.to_string()))?
                .await
                .map_err(|e| {
                    not_confirmed(match e.kind() {
                        jetstream::context::PublishErrorKind::StreamNotFound => format!(
                            "no stream captures the subject {subject}; set redrive_to to a subject a stream captures, or to the stream's name"
                        ),
                        _ => e.to_string(),
                    })
                })?;
            if ack.duplicate {
                return Err(not_confirmed(format!(
                    "stream {} took it as a duplicate of sequence {} (Nats-Msg-Id {}), so it was not stored again; retry the redrive",
                    ack.stream, ack.sequence, msg.dedup_id
                )));
            }
            Ok(())
        })
    }

    fn check_limits(&self, attempts_max: u32) -> BoxFuture<'_, Vec<String>> {
        Box::pin(async move {
            let mut warnings = Vec::new();
            let (stream, group) = (&self.spec.queue, &self.spec.group);
            let info = match self.js.get_stream_no_info(stream).await {
                Ok(s) => s.consumer_info(group).await,
                Err(_) => return warnings,
            };
            // A consumer not there yet is created with no MaxDeliver.
            let Ok(info) = info else { return warnings };
            let max_deliver = info.config.max_deliver;
            if max_deliver > 0 && max_deliver <= i64::from(attempts_max) {
                warnings.push(format!(
                    "JetStream consumer {group} of stream {stream} has MaxDeliver = {max_deliver}, not more than the policy's attempts_max = {attempts_max}: JetStream may stop delivering a message before the policy's budget is spent. lazaret acknowledges a message before each retry of its own, so MaxDeliver only counts deliveries that ended without an acknowledgement (lazaret crashed or was killed); raise MaxDeliver above attempts_max, or set it to -1"
                ));
            }
            // The guard sends an in-progress ack every delivery_timeout / 4,
            // between 0.5 s and 10 s (`guard.rs`, `attempt`): an AckWait
            // shorter than two of those lets a running message be redelivered.
            let ack_wait = info.config.ack_wait;
            let every = (self.spec.delivery_timeout / 4)
                .clamp(Duration::from_millis(500), Duration::from_secs(10));
            if ack_wait < every * 2 {
                warnings.push(format!(
                    "JetStream consumer {group} of stream {stream} has AckWait = {ack_wait:?}, while lazaret keeps a running message from redelivery with an in-progress ack every {every:?}: JetStream may redeliver a message whose handler still runs; raise AckWait to the source's delivery_timeout_ms plus 5 s (what lazaret gives the consumers it creates)"
                ));
            }
            warnings
        })
    }

    fn interpret<'a>(&'a self, d: &'a Delivery) -> BoxFuture<'a, Result<TakenIn, BrokerError>> {
        Box::pin(async move {
            if let Some(adv) = parse_advisory(&d.body) {
                let original = self.original(&adv).await?;
                return Ok(adv.taken_in(original));
            }
            Ok(copied_dead_message(d))
        })
    }
}

impl Nats {
    /// The message an advisory names, fetched by sequence; `None` when its
    /// stream no longer has it.
    async fn original(&self, adv: &Advisory) -> Result<Option<Delivery>, BrokerError> {
        let what = || format!("get message {} of stream {}", adv.stream_seq, adv.stream);
        let stream = self
            .js
            .get_stream_no_info(&adv.stream)
            .await
            .map_err(|e| op(what())(&e))?;
        match stream.get_raw_message(adv.stream_seq).await {
            Ok(m) => {
                let headers = headers_json(Some(&m.headers));
                let mut d = delivery(
                    &adv.stream,
                    m.sequence,
                    m.subject.as_str(),
                    m.payload.to_vec(),
                    headers,
                    adv.deliveries,
                );
                d.resolve_id();
                Ok(Some(d))
            }
            Err(e) => match e.kind() {
                RawMessageErrorKind::NoMessageFound => Ok(None),
                RawMessageErrorKind::JetStream(j)
                    if j.error_code() == ErrorCode::STREAM_NOT_FOUND
                        || j.error_code() == ErrorCode::NO_MESSAGE_FOUND =>
                {
                    Ok(None)
                }
                _ => Err(op(what())(&e)),
            },
        }
    }
}

/// A pulled message not handed to the runtime yet.
struct Buffered {
    delivery: Delivery,
    reply: Subject,
}

/// Pulled messages not handed to the runtime yet, shared by the consumer,
/// the task pulling them in and the one keeping them from redelivery.
#[derive(Default)]
struct Held {
    queue: VecDeque<Buffered>,
    /// The consumer is gone: whatever a pull still brings is handed back.
    closed: bool,
}

/// The consumer of one guard or watch: pulls batches no larger than the
/// deliveries the runtime may still start, hands them out one by one.
struct Pull {
    js: jetstream::Context,
    consumer: PullConsumer,
    stream: String,
    /// The source's concurrency: at most this many messages unsettled.
    limit: usize,
    /// Pulled, not handed out yet; kept from redelivery by `keepalive`.
    held: Arc<Mutex<Held>>,
    /// Handed out and not settled yet.
    outstanding: Arc<AtomicUsize>,
    keepalive: tokio::task::JoinHandle<()>,
    /// The pull under way, a task of its own: when the runtime gives up
    /// waiting (shutdown), what the pull still brings is handed back rather
    /// than left to wait out the ack wait.
    pulling: Option<tokio::task::JoinHandle<Result<(), BrokerError>>>,
}

impl Pull {
    fn pop(&self) -> Option<Incoming> {
        let b = lock(&self.held).queue.pop_front()?;
        self.outstanding.fetch_add(1, Ordering::SeqCst);
        Some(Incoming {
            delivery: b.delivery,
            ack: Box::new(NatsAck {
                acker: jetstream::message::Acker::new(self.js.clone(), Some(b.reply)),
                outstanding: Arc::clone(&self.outstanding),
            }),
        })
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Consumer for Pull {
    fn next(&mut self) -> BoxFuture<'_, Result<Option<Incoming>, BrokerError>> {
        Box::pin(async move {
            loop {
                if let Some(i) = self.pop() {
                    return Ok(Some(i));
                }
                let task = match &mut self.pulling {
                    Some(task) => task,
                    None => {
                        // The runtime asks only when it can start one; it can
                        // start as many as are not running yet.
                        let want = self
                            .limit
                            .saturating_sub(self.outstanding.load(Ordering::SeqCst))
                            .max(1);
                        self.pulling.insert(tokio::spawn(pull_once(
                            self.consumer.clone(),
                            want,
                            Arc::clone(&self.held),
                            self.js.client(),
                            self.stream.clone(),
                        )))
                    }
                };
                // Awaiting a task by reference: dropping this future (the
                // runtime's shutdown) leaves the pull to finish on its own.
                let done = task.await;
                self.pulling = None;
                match done {
                    Ok(pulled) => pulled?,
                    Err(e) => return Err(op(format!("pull from stream {}", self.stream))(&e)),
                }
            }
        })
    }
}

/// One pull request for up to `want` messages, into `held` (or handed back
/// if the consumer is gone by the time they arrive).
async fn pull_once(
    consumer: PullConsumer,
    want: usize,
    held: Arc<Mutex<Held>>,
    client: async_nats::Client,
    stream: String,
) -> Result<(), BrokerError> {
    let pulling = || {
        format!(
            "pull from consumer {} of stream {stream}",
            consumer.cached_info().name
        )
    };
    // A one-shot request: the server answers as soon as it has any message
    // (or after PULL_WAIT with none), so no request is left on the server
    // waiting for messages once this one ends.
    let asked = tokio::time::Instant::now();
    let mut batch = consumer
        .fetch()
        .max_messages(want)
        .expires(PULL_WAIT)
        .messages()
        .await
        .map_err(|e| op(pulling())(&e))?;
    let mut got = 0;
    while let Some(m) = batch.next().await {
        let m = m.map_err(|e| op(pulling())(&*e))?;
        let b = buffered(&stream, m).map_err(|e| op(pulling())(&e))?;
        got += 1;
        let mut h = lock(&held);
        if h.closed {
            drop(h);
            nak_later(client.clone(), vec![b.reply]);
        } else {
            h.queue.push_back(b);
        }
    }
    if got == 0 && asked.elapsed() < PULL_WAIT / 2 {
        // The server answered "nothing" at once rather than waiting (servers
        // older than 2.9 do): do not spin.
        tokio::time::sleep(PULL_WAIT / 4).await;
    }
    Ok(())
}

impl Drop for Pull {
    fn drop(&mut self) {
        self.keepalive.abort();
        let unstarted: Vec<Subject> = {
            let mut h = lock(&self.held);
            h.closed = true;
            h.queue.drain(..).map(|b| b.reply).collect()
        };
        if !unstarted.is_empty() {
            // Hand back what was pulled and never started, so the broker
            // redelivers it now rather than after the ack wait. (lazaret
            // wrote nothing about these: however JetStream counts the
            // redelivery, nothing is lost.)
            nak_later(self.js.client(), unstarted);
        }
    }
}

/// Sends `-NAK` for each of `replies` from a task (a `Drop` cannot wait).
fn nak_later(client: async_nats::Client, replies: Vec<Subject>) {
    if let Ok(rt) = tokio::runtime::Handle::try_current() {
        rt.spawn(async move {
            for r in replies {
                let _ = client.publish(r, AckKind::Nak(None).into()).await;
            }
            let _ = client.flush().await;
        });
    }
}

/// Sends in-progress acks for the pulled messages the runtime has not
/// started yet (it may be waiting on a breaker or a pause), until the
/// consumer is dropped.
async fn keep_alive(client: async_nats::Client, held: Weak<Mutex<Held>>, every: Duration) {
    loop {
        tokio::time::sleep(every).await;
        let Some(held) = held.upgrade() else {
            return;
        };
        let replies: Vec<Subject> = lock(&held).queue.iter().map(|b| b.reply.clone()).collect();
        drop(held);
        for r in replies {
            let _ = client.publish(r, AckKind::Progress.into()).await;
        }
    }
}

/// Settles one pulled message.
///
/// Dropped unsettled (the runtime stopped mid-delivery, or crashed), it
/// sends nothing: JetStream redelivers the message after the ack wait, with
/// its delivery count raised, so the redelivery is checked against what
/// lazaret wrote down. (A `-NAK` would be quicker, but nats-server 2.9 can
/// hand a nakked message out again with its delivery count back at 1 when
/// the nak races an abandoned pull request, and the redelivery would then
/// look like a first one.)
struct NatsAck {
    acker: jetstream::message::Acker,
    outstanding: Arc<AtomicUsize>,
}

impl NatsAck {
    fn settle(
        self: Box<Self>,
        kind: AckKind,
        what: &'static str,
    ) -> BoxFuture<'static, Result<(), BrokerError>> {
        Box::pin(async move {
            let r = match kind {
                // Awaits the server's confirmation: lazaret wants to know the
                // message is gone before it forgets it.
                AckKind::Ack => self.acker.double_ack().await,
                other => self.acker.ack_with(other).await,
            };
            r.map_err(|e| op(what)(&*e))
        })
    }
}

impl Drop for NatsAck {
    fn drop(&mut self) {
        self.outstanding.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Acker for NatsAck {
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), BrokerError>> {
        self.settle(AckKind::Ack, "ack")
    }

    fn progress(&self) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(async move {
            self.acker
                .ack_with(AckKind::Progress)
                .await
                .map_err(|e| op("in-progress ack")(&*e))
        })
    }

    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), BrokerError>> {
        self.settle(AckKind::Nak(None), "nak")
    }
}

/// Fuzzing only (`fuzz/`, target `broker_headers`): a pulled JetStream
/// message (its `$JS.ACK.…` reply subject, subject, headers and body) as
/// the delivery the runtime gets, exactly as a pull does.
#[doc(hidden)]
pub fn fuzz_pulled(stream: &str, m: jetstream::Message) -> Result<Delivery, String> {
    buffered(stream, m).map(|b| b.delivery)
}

/// Fuzzing only (`fuzz/`, target `broker_headers`): what the watch reads of
/// a message of a dead-message stream, an advisory or a copied message, as
/// [`Broker::interpret`] does when the advisory's message is gone.
#[doc(hidden)]
pub fn fuzz_interpret(d: &Delivery) -> TakenIn {
    match parse_advisory(&d.body) {
        Some(adv) => adv.taken_in(None),
        None => copied_dead_message(d),
    }
}

/// A pulled message as the runtime sees it.
fn buffered(stream: &str, m: jetstream::Message) -> Result<Buffered, String> {
    let info = m
        .info()
        .map_err(|e| format!("a message without JetStream metadata ({e})"))?;
    let (seq, delivered) = (info.stream_sequence, info.delivered);
    let reply = m
        .reply
        .clone()
        .ok_or_else(|| "a message without a reply subject".to_owned())?;
    let headers = headers_json(m.headers.as_ref());
    let delivery = delivery(
        stream,
        seq,
        m.subject.as_str(),
        m.payload.to_vec(),
        headers,
        u32::try_from(delivered.max(0)).unwrap_or(u32::MAX),
    );
    Ok(Buffered { delivery, reply })
}

/// A JetStream message as a [`Delivery`]: the id is `Nats-Msg-Id`, else
/// `<stream>:<sequence>`; `delivered` is JetStream's delivery count.
fn delivery(
    stream: &str,
    seq: u64,
    subject: &str,
    body: Vec<u8>,
    headers: Map<String, Value>,
    delivered: u32,
) -> Delivery {
    let find = |name: &str| {
        headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .and_then(|(_, v)| match v {
                Value::Array(a) => a.last().and_then(header_text),
                v => header_text(v),
            })
            .filter(|s| !s.is_empty())
    };
    let message_id = find(MSG_ID).unwrap_or_else(|| format!("{stream}:{seq}"));
    let content_type = find("Content-Type");
    Delivery {
        message_id,
        body,
        content_type,
        headers,
        broker_prior: delivered.saturating_sub(1),
        redelivered: delivered > 1,
        queue: stream.to_owned(),
        position: json!({"stream_seq": seq, "subject": subject}),
    }
}

/// NATS headers as JSON: one value as a string, several as an array.
fn headers_json(h: Option<&HeaderMap>) -> Map<String, Value> {
    let mut out = Map::new();
    for (name, values) in h.into_iter().flat_map(HeaderMap::iter) {
        let name: &str = name.as_ref();
        let value = match values.as_slice() {
            [one] => Value::String(one.as_str().to_owned()),
            many => Value::Array(
                many.iter()
                    .map(|v| Value::String(v.as_str().to_owned()))
                    .collect(),
            ),
        };
        out.insert(name.to_owned(), value);
    }
    out
}

/// JSON headers as NATS headers: strings as they are, `{"base64"}` decoded
/// when it is UTF-8, numbers and booleans as text, arrays as several
/// values.
fn to_nats_headers(h: &Map<String, Value>) -> Result<HeaderMap, String> {
    let mut out = HeaderMap::new();
    for (name, value) in h {
        let n: HeaderName = name.parse().map_err(|_| {
            format!(
                "the header name {name:?} is not one NATS can carry (printable ASCII without ':')"
            )
        })?;
        let values: Vec<&Value> = match value {
            Value::Array(a) => a.iter().collect(),
            Value::Null => Vec::new(),
            v => vec![v],
        };
        for v in values {
            let text = match v {
                Value::Object(_) => {
                    String::from_utf8(value_bytes(v)).unwrap_or_else(|_| v.to_string())
                }
                v => header_text(v).unwrap_or_else(|| v.to_string()),
            };
            let hv: HeaderValue = text.parse().map_err(|_| {
                format!("the header {name} has a line break, which NATS headers cannot carry")
            })?;
            out.append(n.clone(), hv);
        }
    }
    Ok(out)
}

/// Which advisory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AdvisoryKind {
    /// `MaxDeliver` reached.
    MaxDeliveries,
    /// The consumer terminated the message (`+TERM`).
    Terminated,
}

/// What a JetStream consumer advisory says about the message it names.
#[derive(Clone, Debug, PartialEq)]
struct Advisory {
    kind: AdvisoryKind,
    stream: String,
    consumer: String,
    stream_seq: u64,
    deliveries: u32,
    timestamp: Option<Timestamp>,
    /// The termination reason, when the server gives one.
    reason: Option<String>,
}

/// A `max_deliver` or `terminated` advisory, read from its JSON body;
/// `None` for anything else.
fn parse_advisory(body: &[u8]) -> Option<Advisory> {
    let v: Value = serde_json::from_slice(body).ok()?;
    let kind = match v.get("type")?.as_str()? {
        MAX_DELIVER_TYPE => AdvisoryKind::MaxDeliveries,
        TERMINATED_TYPE => AdvisoryKind::Terminated,
        _ => return None,
    };
    let text = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_owned);
    Some(Advisory {
        kind,
        stream: text("stream").filter(|s| !s.is_empty())?,
        consumer: text("consumer").unwrap_or_default(),
        stream_seq: v.get("stream_seq")?.as_u64()?,
        deliveries: v
            .get("deliveries")
            .and_then(Value::as_u64)
            .map_or(0, |d| u32::try_from(d).unwrap_or(u32::MAX)),
        timestamp: text("timestamp").as_deref().and_then(parse_rfc3339),
        reason: text("reason").filter(|r| !r.is_empty()),
    })
}

impl Advisory {
    /// The dead letter an advisory stands for; `original` is the message it
    /// names, `None` when its stream no longer has it.
    fn taken_in(&self, original: Option<Delivery>) -> TakenIn {
        let (reason, kind, mut message) = match self.kind {
            AdvisoryKind::MaxDeliveries => (
                DeadLetterReason::MaxDeliveries,
                "max_deliveries",
                format!(
                    "JetStream consumer {} of stream {} delivered message {} {} times (its MaxDeliver) without an acknowledgement, and stopped delivering it",
                    self.consumer, self.stream, self.stream_seq, self.deliveries
                ),
            ),
            AdvisoryKind::Terminated => (
                DeadLetterReason::Rejected,
                "terminated",
                format!(
                    "JetStream consumer {} of stream {} terminated message {} (AckTerm) after {} deliveries{}",
                    self.consumer,
                    self.stream,
                    self.stream_seq,
                    self.deliveries,
                    self.reason
                        .as_ref()
                        .map_or_else(String::new, |r| format!(": {r}"))
                ),
            ),
        };
        let position = match &original {
            Some(d) => d.position.clone(),
            None => {
                message.push_str(
                    "; the message itself is gone from the stream (its retention removed it), so this dead letter holds the advisory instead",
                );
                json!({"stream_seq": self.stream_seq})
            }
        };
        TakenIn {
            reason: Some(reason),
            error: Some(Failure::new(kind, message)),
            original_queue: Some(self.stream.clone()),
            original_position: Some(position),
            attempts: self.deliveries,
            first_at: self.timestamp,
            original,
        }
    }
}

/// A dead message some consumer copied into the stream: the reason and
/// original stream come from its headers, when it names them.
fn copied_dead_message(d: &Delivery) -> TakenIn {
    let reason = d.header(REASON_HEADER).and_then(|word| {
        DeadLetterReason::ALL
            .into_iter()
            .find(|r| r.is_broker() && r.as_str() == word.trim())
    });
    TakenIn {
        reason,
        original_queue: d.header(ORIGINAL_STREAM_HEADER).filter(|s| !s.is_empty()),
        ..TakenIn::default()
    }
}

/// An RFC 3339 UTC instant (`2024-05-01T12:00:00.123456789Z`, or with an
/// offset) as a [`Timestamp`], to the millisecond.
fn parse_rfc3339(s: &str) -> Option<Timestamp> {
    let b = s.as_bytes();
    if b.len() < 20 || b[4] != b'-' || b[7] != b'-' || !matches!(b[10], b'T' | b't' | b' ') {
        return None;
    }
    let num = |r: std::ops::Range<usize>| -> Option<i64> { s.get(r)?.parse().ok() };
    let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let (hour, min, sec) = (num(11..13)?, num(14..16)?, num(17..19)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || hour > 23 || min > 59 || sec > 60 {
        return None;
    }
    let mut rest = &s[19..];
    let mut millis = 0i64;
    if let Some(frac) = rest.strip_prefix('.') {
        let digits = frac.bytes().take_while(u8::is_ascii_digit).count();
        if digits == 0 {
            return None;
        }
        let first3: String = frac[..digits]
            .chars()
            .chain("000".chars())
            .take(3)
            .collect();
        millis = first3.parse().ok()?;
        rest = &frac[digits..];
    }
    let offset_min = match rest {
        "Z" | "z" => 0,
        _ if rest.len() == 6
            && (rest.starts_with('+') || rest.starts_with('-'))
            && rest.as_bytes()[3] == b':' =>
        {
            let h: i64 = rest.get(1..3)?.parse().ok()?;
            let m: i64 = rest.get(4..6)?.parse().ok()?;
            let sign = if rest.starts_with('-') { -1 } else { 1 };
            sign * (h * 60 + m)
        }
        _ => return None,
    };
    // Days since the epoch of a proleptic Gregorian date (Howard Hinnant's
    // days_from_civil).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let secs = days * 86_400 + hour * 3600 + min * 60 + sec - offset_min * 60;
    Some(Timestamp::from_millis(secs * 1000 + millis))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn advisory_json(kind: &str) -> Vec<u8> {
        json!({
            "type": kind,
            "id": "kPPvyxlTKXyjgHEAJBZ2Oc",
            "timestamp": "2024-05-01T12:00:01.5Z",
            "stream": "ORDERS",
            "consumer": "lazaret",
            "consumer_seq": 7,
            "stream_seq": 42,
            "deliveries": 5,
            "domain": ""
        })
        .to_string()
        .into_bytes()
    }

    #[test]
    fn a_max_deliver_advisory_names_the_message_and_its_deliveries() {
        let adv = parse_advisory(&advisory_json(MAX_DELIVER_TYPE)).expect("an advisory");
        assert_eq!(
            adv,
            Advisory {
                kind: AdvisoryKind::MaxDeliveries,
                stream: "ORDERS".into(),
                consumer: "lazaret".into(),
                stream_seq: 42,
                deliveries: 5,
                timestamp: Some(Timestamp::from_millis(1_714_564_801_500)),
                reason: None,
            }
        );
        let original = delivery("ORDERS", 42, "orders.new", b"{}".to_vec(), Map::new(), 5);
        let t = adv.taken_in(Some(original.clone()));
        assert_eq!(t.reason, Some(DeadLetterReason::MaxDeliveries));
        assert_eq!(t.original_queue.as_deref(), Some("ORDERS"));
        assert_eq!(
            t.original_position,
            Some(json!({"stream_seq": 42, "subject": "orders.new"}))
        );
        assert_eq!(t.attempts, 5);
        assert_eq!(t.first_at, Some(Timestamp::from_millis(1_714_564_801_500)));
        let error = t.error.expect("an error");
        assert_eq!(error.kind.to_string(), "max_deliveries");
        for part in ["ORDERS", "lazaret", "5 times"] {
            assert!(error.message.contains(part), "{part} in {}", error.message);
        }
        assert_eq!(t.original, Some(original));
    }

    #[test]
    fn a_terminated_advisory_is_a_rejection() {
        let adv = parse_advisory(&advisory_json(TERMINATED_TYPE)).expect("an advisory");
        assert_eq!(adv.kind, AdvisoryKind::Terminated);
        let t = adv.taken_in(None);
        assert_eq!(t.reason, Some(DeadLetterReason::Rejected));
        let error = t.error.expect("an error");
        assert!(error.message.contains("AckTerm"), "{}", error.message);
        assert!(
            error.message.contains("gone from the stream"),
            "{}",
            error.message
        );
        assert_eq!(t.original_position, Some(json!({"stream_seq": 42})));
        assert_eq!(t.original, None);
    }

    #[test]
    fn other_messages_are_no_advisories() {
        assert_eq!(parse_advisory(b"hello"), None);
        assert_eq!(
            parse_advisory(br#"{"type": "io.nats.jetstream.advisory.v1.api_audit"}"#),
            None
        );
        assert_eq!(
            parse_advisory(br#"{"type": "io.nats.jetstream.advisory.v1.max_deliver"}"#),
            None
        );
    }

    #[test]
    fn a_copied_dead_message_names_its_reason_and_stream_in_headers() {
        let mut d = delivery("DLQ", 3, "dlq", b"x".to_vec(), Map::new(), 1);
        assert_eq!(copied_dead_message(&d), TakenIn::default());
        d.headers.insert("lazaret-reason".into(), json!("expired"));
        d.headers
            .insert("Lazaret-Original-Stream".into(), json!("ORDERS"));
        let t = copied_dead_message(&d);
        assert_eq!(t.reason, Some(DeadLetterReason::Expired));
        assert_eq!(t.original_queue.as_deref(), Some("ORDERS"));
        // Not a broker reason: the default (rejected) applies.
        d.headers
            .insert("lazaret-reason".into(), json!("permanent"));
        assert_eq!(copied_dead_message(&d).reason, None);
    }

    #[test]
    fn the_id_is_nats_msg_id_else_stream_and_sequence() {
        let h = json!({"Nats-Msg-Id": "order-7", "Content-Type": "application/json"});
        let d = delivery(
            "S",
            9,
            "s",
            vec![],
            h.as_object().cloned().unwrap_or_default(),
            3,
        );
        assert_eq!(d.message_id, "order-7");
        assert_eq!(d.content_type.as_deref(), Some("application/json"));
        assert_eq!((d.broker_prior, d.redelivered), (2, true));
        let d = delivery("S", 9, "s", vec![], Map::new(), 1);
        assert_eq!(d.message_id, "S:9");
        assert_eq!((d.broker_prior, d.redelivered), (0, false));
        assert_eq!(d.position, json!({"stream_seq": 9, "subject": "s"}));
    }

    #[test]
    fn headers_travel_both_ways() {
        let h = json!({
            "a": "text", "n": 3, "b": true, "many": ["x", "y"],
            "bin": {"base64": "aGk="}, "raw": {"base64": "/wA="}
        });
        let map = to_nats_headers(h.as_object().unwrap_or(&Map::new())).expect("valid headers");
        let back = headers_json(Some(&map));
        assert_eq!(
            Value::Object(back),
            json!({
                "a": "text", "n": "3", "b": "true", "many": ["x", "y"],
                "bin": "hi", "raw": "{\"base64\":\"/wA=\"}"
            })
        );
        let bad = json!({"a": "line\r\nbreak"});
        assert!(to_nats_headers(bad.as_object().unwrap_or(&Map::new())).is_err());
        let bad = json!({"a b": "x"});
        assert!(to_nats_headers(bad.as_object().unwrap_or(&Map::new())).is_err());
    }

    #[test]
    fn a_redrive_goes_to_the_original_subject_or_the_streams_only_one() {
        let one = vec!["orders".to_owned()];
        let wild = vec!["orders.*".to_owned(), "refunds.>".to_owned()];
        assert_eq!(pick_subject("S", &one, None), Ok("orders"));
        assert_eq!(pick_subject("S", &one, Some("dlq.x")), Ok("orders"));
        assert_eq!(pick_subject("S", &wild, Some("orders.eu")), Ok("orders.eu"));
        assert_eq!(
            pick_subject("S", &wild, Some("refunds.eu.x")),
            Ok("refunds.eu.x")
        );
        let err = pick_subject("S", &wild, Some("orders.eu.x")).expect_err("ambiguous");
        assert!(err.contains("redrive_to"), "{err}");
        assert!(pick_subject("S", &[], None).is_err());
        assert!(is_stream_name("ORDERS"));
        assert!(!is_stream_name("orders.retry"));
    }

    #[test]
    fn subject_filters_match_tokens() {
        assert!(subject_matches("a.*.c", "a.b.c"));
        assert!(subject_matches("a.>", "a.b.c"));
        assert!(!subject_matches("a.>", "a"));
        assert!(!subject_matches("a.*", "a.b.c"));
        assert!(subject_matches("a", "a"));
        assert!(!subject_matches("a", "b"));
    }

    #[test]
    fn advisory_timestamps_are_rfc3339() {
        assert_eq!(
            parse_rfc3339("1970-01-01T00:00:00Z"),
            Some(Timestamp::from_millis(0))
        );
        assert_eq!(
            parse_rfc3339("2024-02-29T23:59:59.999999999Z"),
            Some(Timestamp::from_millis(1_709_251_199_999))
        );
        assert_eq!(
            parse_rfc3339("2024-03-01T01:00:00+01:00"),
            Some(Timestamp::from_millis(1_709_251_200_000))
        );
        assert_eq!(parse_rfc3339("yesterday"), None);
        assert_eq!(parse_rfc3339("2024-13-01T00:00:00Z"), None);
    }
}
