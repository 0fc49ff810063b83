//! The Amazon SQS adapter: a source's `url` is the endpoint URL (empty: the
//! region's AWS endpoint), its `queue` a queue URL (or a queue name, looked
//! up with `GetQueueUrl`). Credentials and region come from the standard
//! AWS chain (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`,
//! `~/.aws/config` and `credentials`, web identity, the instance's role).
//!
//! # Guard mode
//!
//! A message maps onto a delivery as the contract's table says:
//!
//! - body: the message body;
//! - message id: the message attribute `message_id`, else the SQS
//!   MessageId (`x-lazaret-message-id` wins, as for every broker);
//! - headers: the message attributes (String and Number ones as text,
//!   Binary ones as `{"base64": …}`), with the fields of the JSON attribute
//!   `lazaret` (`x-lazaret-message-id`, `x-lazaret-attempt`, `traceparent`)
//!   in place of it: SQS allows ten attributes a message, so lazaret's own
//!   share one (a producer's own `traceparent` attribute is read too);
//! - content type: the attribute `content_type`, if any;
//! - the broker's count of earlier deliveries: `ApproximateReceiveCount` − 1;
//! - position: `{"message_id", "receive_count", "group_id",
//!   "sequence_number", "sent_at_ms"}` (the last three when SQS says them).
//!
//! Each receive makes the message invisible for twice the source's
//! `delivery_timeout_ms` (5 s to 12 h); while a delivery runs lazaret
//! extends that (`ChangeMessageVisibility`), and an acknowledgement is
//! a delete.
//!
//! # Batched calls
//!
//! A standard queue is read by `receives_in_flight` `ReceiveMessage` calls
//! at once (default 2), each for up to 10 messages, so a slow receive does
//! not leave the handlers idle. Deletes and visibility changes are
//! coalesced: each waits at most [`BATCH_WAIT`] (or until [`BATCH_MAX`] are
//! pending) and they go as one `DeleteMessageBatch` or
//! `ChangeMessageVisibilityBatch` (a lone one as the single call). A delete
//! is asked for only once the message's outcome is durable, and a batch
//! names each message by its receipt handle, so it never covers a message
//! not yet settled. An entry the batch reports failed is retried alone with
//! the single call, whose answer is the ack's.
//!
//! **Standard queues** hold a retry in lazaret's store and delete the
//! message, as the other brokers do: the wait holds nothing up, does not
//! count against the queue's `maxReceiveCount`, survives a restart, and has
//! no 12-hour limit. **FIFO queues** must keep their group order: a failing
//! message may hold only its own group, so it is not deleted. Its retry or
//! deferral waits on the queue: lazaret records the envelope in its store
//! and changes the message's visibility to the backoff (at most what is
//! left of the 12 hours SQS allows from a receive; a longer wait is held
//! again when the message comes back early). The receive that follows is
//! lazaret's own doing: the recorded envelope resumes, so it counts
//! neither as a crash nor, after a deferral, as an attempt. A FIFO queue is
//! read one message at a time, since SQS hands a batch out of one group.
//!
//! lazaret warns at start when a FIFO queue's `maxReceiveCount` is at most
//! the policy's `attempts_max` (every retry there is a receive, so SQS
//! would move the message to its dead-letter queue first).
//!
//! # Watch mode
//!
//! `queue` is a dead-letter queue: another queue's `RedrivePolicy` names it
//! as `deadLetterTargetArn`. Each message is filed with reason
//! `max_receives`, its receive count as attempts and the queue it came
//! from: the one queue `ListDeadLetterSourceQueues` names (else, when it
//! names several or none, `redrive_to`, which is then required).
//!
//! A redrive sends the message back (`SendMessage`) with its attributes
//! minus lazaret's, plus the attribute `lazaret` =
//! `{"x-lazaret-message-id": …, "x-lazaret-attempt": "0", "traceparent": …}`
//! (the trace context only when the dead letter has one); to a FIFO queue
//! with its original group id and a fresh deduplication id (SQS drops a
//! repeated one for five minutes).

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use aws_config::BehaviorVersion;
use aws_sdk_sqs::Client;
use aws_sdk_sqs::error::DisplayErrorContext;
use aws_sdk_sqs::primitives::Blob;
use aws_sdk_sqs::types::{
    Message, MessageAttributeValue, MessageSystemAttributeName, QueueAttributeName,
};
use aws_smithy_http_client::tls::{self, rustls_provider::CryptoMode};
use futures_util::StreamExt;
use futures_util::future::BoxFuture;
use futures_util::stream::FuturesUnordered;
use lazaret_core::{DeadLetterReason, Failure, Timestamp};
use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::broker::{Acker, Broker, BrokerError, Consumer, Incoming};
use crate::message::TakenIn;
use crate::message::{Delivery, Republish, bytes_value, header_text, value_bytes};
use crate::spec::{Mode, SourceSpec};

/// The AWS SDK for SQS this adapter uses, for callers that set queues up.
pub use aws_sdk_sqs as sdk;

/// The message attribute that carries lazaret's own fields as one JSON
/// object.
pub const LAZARET_ATTRIBUTE: &str = "lazaret";

/// The longest SQS keeps a message invisible, counted from its receive.
pub const VISIBILITY_MAX: Duration = Duration::from_secs(12 * 60 * 60);

/// How long a delete or a visibility change waits for others to share one
/// batch request.
pub const BATCH_WAIT: Duration = Duration::from_millis(2);
/// The most entries SQS takes in one batch request.
pub const BATCH_MAX: usize = 10;

/// How long a receive waits for a message (long polling).
const RECEIVE_WAIT_SECS: i32 = 5;
/// The same for a FIFO queue, shorter: a receive that starts while a
/// group's message is in flight may not see the group's next message
/// until it returns (moto's server works so; SQS documents nothing either
/// way), and a group should not wait 5 s for that.
const RECEIVE_WAIT_FIFO_SECS: i32 = 2;

const BROKER: &str = "sqs";

/// Opens the adapter: the AWS configuration from the environment, the
/// queue's attributes, and for a watch the queue it is the dead-letter
/// queue of.
pub async fn connect(spec: &SourceSpec) -> Result<Box<dyn Broker>, BrokerError> {
    let client = client(&spec.url).await?;
    let unreachable = |why: String| BrokerError::Connect {
        broker: BROKER,
        url: if spec.url.is_empty() {
            "the AWS endpoint".into()
        } else {
            spec.url.clone()
        },
        why,
    };
    let queue_url = queue_url(&client, &spec.queue)
        .await
        .map_err(&unreachable)?;
    let attrs = client
        .get_queue_attributes()
        .queue_url(&queue_url)
        .attribute_names(QueueAttributeName::All)
        .send()
        .await
        .map_err(|e| {
            unreachable(format!(
                "GetQueueAttributes {queue_url}: {}",
                DisplayErrorContext(&e)
            ))
        })?;
    let attr = |name: QueueAttributeName| attrs.attributes().and_then(|a| a.get(&name)).cloned();
    let fifo = attr(QueueAttributeName::FifoQueue).is_some_and(|v| v == "true");
    let max_receives = attr(QueueAttributeName::RedrivePolicy).and_then(|p| max_receive_count(&p));
    let mut source_queue = None;
    let mut source_max_receives = None;
    if spec.mode == Mode::Watch {
        let sources = client
            .list_dead_letter_source_queues()
            .queue_url(&queue_url)
            .send()
            .await
            .map_err(|e| {
                unreachable(format!(
                    "ListDeadLetterSourceQueues {queue_url}: {}",
                    DisplayErrorContext(&e)
                ))
            })?;
        match sources.queue_urls() {
            [one] => {
                source_queue = Some(one.clone());
                source_max_receives = client
                    .get_queue_attributes()
                    .queue_url(one)
                    .attribute_names(QueueAttributeName::RedrivePolicy)
                    .send()
                    .await
                    .ok()
                    .and_then(|o| {
                        o.attributes()
                            .and_then(|a| a.get(&QueueAttributeName::RedrivePolicy))
                            .and_then(|p| max_receive_count(p))
                    });
            }
            others if spec.redrive_to.is_none() => {
                return Err(BrokerError::Config(format!(
                    "source {:?}: SQS names {} queues whose dead-letter queue {queue_url} is ({}), so lazaret cannot tell where its messages came from; set redrive_to to the queue URL a redrive sends them to",
                    spec.name,
                    others.len(),
                    others.join(", ")
                )));
            }
            _ => {}
        }
    }
    let visibility = (spec.delivery_timeout * 2).clamp(Duration::from_secs(5), VISIBILITY_MAX);
    let deletes = Batcher::start(client.clone(), queue_url.clone(), BatchKind::Delete);
    let visibilities = Batcher::start(client.clone(), queue_url.clone(), BatchKind::Visibility);
    Ok(Box::new(Sqs {
        shared: Arc::new(Shared {
            client,
            queue_url,
            deletes,
            visibilities,
            receives_in_flight: if fifo {
                1
            } else {
                spec.receives_in_flight.max(1) as usize
            },
            fifo,
            max_receives,
            source_queue,
            source_max_receives,
            batch: if fifo {
                1
            } else {
                spec.concurrency.clamp(1, 10) as i32
            },
            visibility,
        }),
    }))
}

/// An SQS client on `endpoint` (empty: the region's AWS endpoint), with
/// credentials and region from the standard AWS chain, over rustls with
/// ring.
pub async fn client(endpoint: &str) -> Result<Client, BrokerError> {
    let http = aws_smithy_http_client::Builder::new()
        .tls_provider(tls::Provider::Rustls(CryptoMode::Ring))
        .build_https();
    let mut loader = aws_config::defaults(BehaviorVersion::latest()).http_client(http);
    if !endpoint.is_empty() {
        loader = loader.endpoint_url(endpoint);
    }
    let conf = loader.load().await;
    if conf.region().is_none() {
        return Err(BrokerError::Config(
            "SQS: no AWS region; set AWS_REGION (or a region in ~/.aws/config)".into(),
        ));
    }
    Ok(Client::new(&conf))
}

/// The URL of a queue named by URL or by name.
async fn queue_url(client: &Client, queue: &str) -> Result<String, String> {
    if queue.starts_with("http://") || queue.starts_with("https://") {
        return Ok(queue.to_owned());
    }
    let out = client
        .get_queue_url()
        .queue_name(queue)
        .send()
        .await
        .map_err(|e| format!("GetQueueUrl {queue}: {}", DisplayErrorContext(&e)))?;
    out.queue_url()
        .map(str::to_owned)
        .ok_or_else(|| format!("GetQueueUrl {queue} named no URL"))
}

/// `maxReceiveCount` of a `RedrivePolicy` (a number or a string of one).
pub fn max_receive_count(policy: &str) -> Option<u32> {
    let v: Value = serde_json::from_str(policy).ok()?;
    match v.get("maxReceiveCount")? {
        Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
        Value::String(s) => s.parse().ok(),
        _ => None,
    }
}

struct Shared {
    client: Client,
    queue_url: String,
    deletes: Batcher,
    visibilities: Batcher,
    receives_in_flight: usize,
    fifo: bool,
    max_receives: Option<u32>,
    source_queue: Option<String>,
    source_max_receives: Option<u32>,
    batch: i32,
    visibility: Duration,
}

impl Shared {
    fn op(&self, op: impl Into<String>, e: impl std::error::Error) -> BrokerError {
        BrokerError::Op {
            broker: BROKER,
            op: op.into(),
            why: DisplayErrorContext(e).to_string(),
        }
    }

    async fn change_visibility(&self, handle: &str, secs: i32) -> Result<(), BrokerError> {
        self.visibilities.call(handle.to_owned(), secs).await
    }

    /// One `ReceiveMessage` of up to `batch` messages, on a task of its own
    /// (it runs while the consumer hands out what it has).
    fn spawn_receive(self: &Arc<Self>) -> Receive {
        let s = Arc::clone(self);
        tokio::spawn(async move {
            let visibility = i32::try_from(s.visibility.as_secs()).unwrap_or(43_200);
            let received = Instant::now();
            let out = s
                .client
                .receive_message()
                .queue_url(&s.queue_url)
                .max_number_of_messages(s.batch)
                .wait_time_seconds(if s.fifo {
                    RECEIVE_WAIT_FIFO_SECS
                } else {
                    RECEIVE_WAIT_SECS
                })
                .visibility_timeout(visibility)
                .message_attribute_names("All")
                .message_system_attribute_names(MessageSystemAttributeName::All)
                .send()
                .await
                .map_err(|e| s.op(format!("ReceiveMessage from {}", s.queue_url), e))?;
            Ok(out
                .messages
                .unwrap_or_default()
                .into_iter()
                .map(|m| (m, received))
                .collect())
        })
    }
}

/// A receive in flight: the messages it took, each with its receive's
/// start.
type Receive = JoinHandle<Result<Vec<(Message, Instant)>, BrokerError>>;

/// Which batch call a [`Batcher`] makes.
#[derive(Clone, Copy, Debug)]
enum BatchKind {
    /// `DeleteMessageBatch` (an acknowledgement).
    Delete,
    /// `ChangeMessageVisibilityBatch`.
    Visibility,
}

/// One delete or visibility change waiting for its batch.
struct Pending {
    handle: String,
    /// The visibility timeout to set (unused for a delete).
    secs: i32,
    done: oneshot::Sender<Result<(), BrokerError>>,
}

/// Coalesces the deletes (or the visibility changes) of one queue into
/// batch requests: a task collects what is asked for during
/// [`BATCH_WAIT`] after the first, at most [`BATCH_MAX`], and sends it as
/// one request. The task ends when the adapter is dropped.
struct Batcher {
    tx: mpsc::UnboundedSender<Pending>,
}

impl Batcher {
    fn start(client: Client, queue_url: String, kind: BatchKind) -> Batcher {
        let (tx, mut rx) = mpsc::unbounded_channel::<Pending>();
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let mut batch = vec![first];
                let deadline = Instant::now() + BATCH_WAIT;
                while batch.len() < BATCH_MAX {
                    match tokio::time::timeout_at(deadline, rx.recv()).await {
                        Ok(Some(p)) => batch.push(p),
                        Ok(None) | Err(_) => break,
                    }
                }
                // The next batch collects while this one is on the wire.
                tokio::spawn(send_batch(client.clone(), queue_url.clone(), kind, batch));
            }
        });
        Batcher { tx }
    }

    /// Deletes `handle` (or sets its visibility to `secs`) in the next
    /// batch; the answer is this entry's.
    async fn call(&self, handle: String, secs: i32) -> Result<(), BrokerError> {
        let (done, answer) = oneshot::channel();
        let closed = || {
            BrokerError::Op {
            broker: BROKER,
            op: "a batched SQS call".into(),
            why: "the SQS adapter was shut down; the message is redelivered after its visibility timeout".into(),
        }
        };
        self.tx
            .send(Pending { handle, secs, done })
            .map_err(|_| closed())?;
        answer.await.unwrap_or_else(|_| Err(closed()))
    }
}

fn op_error(op: String, e: impl std::error::Error) -> BrokerError {
    BrokerError::Op {
        broker: BROKER,
        op,
        why: DisplayErrorContext(e).to_string(),
    }
}

/// The single call for one entry: a lone entry, or one its batch failed.
async fn send_one(
    client: &Client,
    queue_url: &str,
    kind: BatchKind,
    p: &Pending,
) -> Result<(), BrokerError> {
    match kind {
        BatchKind::Delete => client
            .delete_message()
            .queue_url(queue_url)
            .receipt_handle(&p.handle)
            .send()
            .await
            .map(drop)
            .map_err(|e| op_error(format!("DeleteMessage from {queue_url}"), e)),
        BatchKind::Visibility => client
            .change_message_visibility()
            .queue_url(queue_url)
            .receipt_handle(&p.handle)
            .visibility_timeout(p.secs)
            .send()
            .await
            .map(drop)
            .map_err(|e| op_error(format!("ChangeMessageVisibility on {queue_url}"), e)),
    }
}

/// Sends one batch and answers each entry: the ids of the entries SQS
/// reports failed are retried alone with the single call.
async fn send_batch(client: Client, queue_url: String, kind: BatchKind, batch: Vec<Pending>) {
    // A batch may name a receipt handle once (moto refuses a repeated
    // one, and its entries' order would say nothing): repeats go alone,
    // after the batch.
    let mut seen = std::collections::HashSet::new();
    let (batch, repeats): (Vec<Pending>, Vec<Pending>) = batch
        .into_iter()
        .partition(|p| seen.insert(p.handle.clone()));
    send_distinct(&client, &queue_url, kind, batch).await;
    for p in repeats {
        let r = send_one(&client, &queue_url, kind, &p).await;
        let _ = p.done.send(r);
    }
}

/// [`send_batch`] of entries with distinct receipt handles.
async fn send_distinct(client: &Client, queue_url: &str, kind: BatchKind, batch: Vec<Pending>) {
    if batch.is_empty() {
        return;
    }
    if let [one] = batch.as_slice() {
        let r = send_one(client, queue_url, kind, one).await;
        if let Some(p) = batch.into_iter().next() {
            let _ = p.done.send(r);
        }
        return;
    }
    let failed: Result<Vec<String>, BrokerError> = match kind {
        BatchKind::Delete => {
            let entries = batch.iter().enumerate().map(|(i, p)| {
                aws_sdk_sqs::types::DeleteMessageBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(&p.handle)
                    .build()
            });
            match entries.collect::<Result<Vec<_>, _>>() {
                Err(e) => Err(op_error(format!("DeleteMessageBatch from {queue_url}"), e)),
                Ok(entries) => client
                    .delete_message_batch()
                    .queue_url(queue_url)
                    .set_entries(Some(entries))
                    .send()
                    .await
                    .map(|o| o.failed().iter().map(|f| f.id().to_owned()).collect())
                    .map_err(|e| op_error(format!("DeleteMessageBatch from {queue_url}"), e)),
            }
        }
        BatchKind::Visibility => {
            let entries = batch.iter().enumerate().map(|(i, p)| {
                aws_sdk_sqs::types::ChangeMessageVisibilityBatchRequestEntry::builder()
                    .id(i.to_string())
                    .receipt_handle(&p.handle)
                    .visibility_timeout(p.secs)
                    .build()
            });
            match entries.collect::<Result<Vec<_>, _>>() {
                Err(e) => Err(op_error(
                    format!("ChangeMessageVisibilityBatch on {queue_url}"),
                    e,
                )),
                Ok(entries) => client
                    .change_message_visibility_batch()
                    .queue_url(queue_url)
                    .set_entries(Some(entries))
                    .send()
                    .await
                    .map(|o| o.failed().iter().map(|f| f.id().to_owned()).collect())
                    .map_err(|e| {
                        op_error(format!("ChangeMessageVisibilityBatch on {queue_url}"), e)
                    }),
            }
        }
    };
    match failed {
        // The whole request failed: each entry is answered as its single
        // call would have been (the same error).
        Err(e) => {
            let why = e.to_string();
            for p in batch {
                let _ = p.done.send(Err(BrokerError::Op {
                    broker: BROKER,
                    op: format!("a batch of {} on {queue_url}", kind_name(kind)),
                    why: why.clone(),
                }));
            }
        }
        Ok(failed) => {
            for (i, p) in batch.into_iter().enumerate() {
                let r = if failed.iter().any(|id| *id == i.to_string()) {
                    send_one(client, queue_url, kind, &p).await
                } else {
                    Ok(())
                };
                let _ = p.done.send(r);
            }
        }
    }
}

fn kind_name(kind: BatchKind) -> &'static str {
    match kind {
        BatchKind::Delete => "deletes",
        BatchKind::Visibility => "visibility changes",
    }
}

/// One SQS queue.
pub struct Sqs {
    shared: Arc<Shared>,
}

impl fmt::Debug for Sqs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sqs")
            .field("queue_url", &self.shared.queue_url)
            .field("fifo", &self.shared.fifo)
            .finish_non_exhaustive()
    }
}

impl Broker for Sqs {
    fn kind(&self) -> &'static str {
        BROKER
    }

    fn consume(&self) -> BoxFuture<'_, Result<Box<dyn Consumer>, BrokerError>> {
        Box::pin(async move {
            Ok(Box::new(QueueConsumer {
                shared: Arc::clone(&self.shared),
                buffer: VecDeque::new(),
                receives: FuturesUnordered::new(),
            }) as Box<dyn Consumer>)
        })
    }

    fn publish(&self, msg: Republish) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(async move {
            let s = &self.shared;
            let not_confirmed = |queue: &str, why: String| BrokerError::NotConfirmed {
                broker: BROKER,
                queue: queue.to_owned(),
                why,
            };
            let url = queue_url(&s.client, &msg.queue)
                .await
                .map_err(|why| not_confirmed(&msg.queue, why))?;
            let body = String::from_utf8(msg.body.clone()).map_err(|_| {
                not_confirmed(
                    &url,
                    "an SQS message body is text, and this payload is not UTF-8".into(),
                )
            })?;
            let attributes = publish_attributes(&msg).map_err(|why| not_confirmed(&url, why))?;
            let mut send = s
                .client
                .send_message()
                .queue_url(&url)
                .message_body(body)
                .set_message_attributes(Some(attributes));
            if url.ends_with(".fifo") {
                let group = msg
                    .position
                    .get("group_id")
                    .and_then(Value::as_str)
                    .map_or_else(|| msg.message_id.clone(), str::to_owned);
                send = send
                    .message_group_id(group)
                    .message_deduplication_id(dedup_id(&msg.dedup_id));
            }
            send.send()
                .await
                .map_err(|e| not_confirmed(&url, DisplayErrorContext(&e).to_string()))?;
            Ok(())
        })
    }

    fn holds_retries(&self) -> bool {
        self.shared.fifo
    }

    fn check_limits(&self, attempts_max: u32) -> BoxFuture<'_, Vec<String>> {
        let warnings = match self.shared.max_receives {
            Some(m) if self.shared.fifo && m <= attempts_max => vec![format!(
                "the FIFO queue {} has maxReceiveCount {m} in its RedrivePolicy, and the policy allows {attempts_max} attempts: every retry and deferral there is a receive, so SQS moves a message to its dead-letter queue before the policy would; raise maxReceiveCount above attempts_max plus the deferrals you expect",
                self.shared.queue_url
            )],
            _ => Vec::new(),
        };
        Box::pin(async move { warnings })
    }

    fn interpret<'a>(&'a self, d: &'a Delivery) -> BoxFuture<'a, Result<TakenIn, BrokerError>> {
        Box::pin(async move {
            Ok(interpret(
                d,
                self.shared.source_queue.as_deref(),
                self.shared.source_max_receives,
            ))
        })
    }
}

/// What an SQS dead-letter queue's message says of itself: reason
/// `max_receives`, its receive count, and the queue it came from.
pub fn interpret(d: &Delivery, source_queue: Option<&str>, max_receives: Option<u32>) -> TakenIn {
    // SQS keeps the receive count when it moves a message; this receive,
    // by the watch, is one more.
    let receives = d.broker_prior.max(max_receives.unwrap_or(0));
    let from = source_queue.unwrap_or("its source queue");
    TakenIn {
        reason: Some(DeadLetterReason::MaxReceives),
        error: Some(Failure::new(
            "max_receives",
            format!(
                "SQS moved it to the dead-letter queue {} after {receives} receives from {from} (maxReceiveCount)",
                d.queue
            ),
        )),
        original_queue: source_queue.map(str::to_owned),
        original_position: None,
        attempts: receives,
        first_at: d
            .position
            .get("sent_at_ms")
            .and_then(Value::as_i64)
            .map(Timestamp::from_millis),
        original: None,
    }
}

/// A deduplication id SQS accepts (at most 128 characters): a hash of
/// the republish's fresh one.
fn dedup_id(fresh: &str) -> String {
    hex::encode(Sha256::digest(fresh.as_bytes()))
}

/// The message attributes of a republish: its headers minus lazaret's,
/// and lazaret's in the one JSON attribute [`LAZARET_ATTRIBUTE`].
pub fn publish_attributes(
    msg: &Republish,
) -> Result<HashMap<String, MessageAttributeValue>, String> {
    let mut out = HashMap::new();
    let mut own = Map::new();
    for (k, v) in &msg.headers {
        // lazaret's fields, and the trace context, share the one attribute.
        if k.to_ascii_lowercase().starts_with("x-lazaret-")
            || k.eq_ignore_ascii_case(crate::trace::TRACEPARENT)
        {
            own.insert(k.clone(), v.clone());
            continue;
        }
        if k == LAZARET_ATTRIBUTE {
            continue;
        }
        out.insert(k.clone(), attribute(v)?);
    }
    if let Some(ct) = &msg.content_type {
        if !msg.headers.contains_key("content_type") {
            out.insert("content_type".into(), string_attribute(ct)?);
        }
    }
    out.insert(
        LAZARET_ATTRIBUTE.into(),
        string_attribute(&Value::Object(own).to_string())?,
    );
    if out.len() > 10 {
        return Err(format!(
            "SQS allows 10 message attributes and this message would carry {} ({}); drop some headers in the dead letter's message before redriving",
            out.len(),
            out.keys().cloned().collect::<Vec<_>>().join(", ")
        ));
    }
    Ok(out)
}

fn string_attribute(s: &str) -> Result<MessageAttributeValue, String> {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(s)
        .build()
        .map_err(|e| e.to_string())
}

fn attribute(v: &Value) -> Result<MessageAttributeValue, String> {
    match v {
        Value::Object(m) if m.len() == 1 && m.contains_key("base64") => {
            MessageAttributeValue::builder()
                .data_type("Binary")
                .binary_value(Blob::new(value_bytes(v)))
                .build()
                .map_err(|e| e.to_string())
        }
        Value::Number(n) => MessageAttributeValue::builder()
            .data_type("Number")
            .string_value(n.to_string())
            .build()
            .map_err(|e| e.to_string()),
        other => string_attribute(&header_text(other).unwrap_or_else(|| other.to_string())),
    }
}

/// A message as a delivery (the contract's table).
pub fn message_delivery(queue_url: &str, m: &Message) -> Delivery {
    let mut headers = Map::new();
    let mut content_type = None;
    for (k, v) in m.message_attributes().into_iter().flatten() {
        let value = match (v.string_value(), v.binary_value()) {
            (Some(s), _) => Value::String(s.to_owned()),
            (None, Some(b)) => bytes_value(b.as_ref()),
            (None, None) => Value::Null,
        };
        if k == LAZARET_ATTRIBUTE {
            if let Some(Value::Object(own)) =
                value.as_str().and_then(|s| serde_json::from_str(s).ok())
            {
                headers.extend(own);
                continue;
            }
        }
        if k == "content_type" {
            content_type = value.as_str().map(str::to_owned);
        }
        headers.insert(k.clone(), value);
    }
    let system = |name: MessageSystemAttributeName| m.attributes().and_then(|a| a.get(&name));
    let receives: u32 = system(MessageSystemAttributeName::ApproximateReceiveCount)
        .and_then(|c| c.parse().ok())
        .unwrap_or(1);
    let sqs_id = m.message_id().unwrap_or_default().to_owned();
    let message_id = headers
        .get("message_id")
        .and_then(header_text)
        .filter(|id| !id.is_empty())
        .unwrap_or_else(|| sqs_id.clone());
    let mut position = json!({"message_id": sqs_id, "receive_count": receives});
    if let Some(g) = system(MessageSystemAttributeName::MessageGroupId) {
        position["group_id"] = Value::String(g.clone());
    }
    if let Some(n) = system(MessageSystemAttributeName::SequenceNumber) {
        position["sequence_number"] = Value::String(n.clone());
    }
    if let Some(t) =
        system(MessageSystemAttributeName::SentTimestamp).and_then(|t| t.parse::<i64>().ok())
    {
        position["sent_at_ms"] = Value::from(t);
    }
    Delivery {
        message_id,
        body: m.body().unwrap_or_default().as_bytes().to_vec(),
        content_type,
        headers,
        broker_prior: receives.saturating_sub(1),
        redelivered: receives > 1,
        queue: queue_url.to_owned(),
        position,
    }
}

struct QueueConsumer {
    shared: Arc<Shared>,
    buffer: VecDeque<(Message, Instant)>,
    /// The receives in flight (at most `receives_in_flight`).
    receives: FuturesUnordered<Receive>,
}

impl QueueConsumer {
    /// Starts receives until `receives_in_flight` batches are buffered or
    /// on their way (each counted as a full one).
    fn top_up(&mut self) {
        let batch = usize::try_from(self.shared.batch).unwrap_or(1).max(1);
        let want = self.shared.receives_in_flight;
        while self.receives.len() < want
            && self.buffer.len() + self.receives.len() * batch < want * batch
        {
            self.receives.push(self.shared.spawn_receive());
        }
    }
}

impl Drop for QueueConsumer {
    fn drop(&mut self) {
        // What they receive comes back after its visibility timeout.
        for r in self.receives.iter() {
            r.abort();
        }
    }
}

impl Consumer for QueueConsumer {
    fn next(&mut self) -> BoxFuture<'_, Result<Option<Incoming>, BrokerError>> {
        Box::pin(async move {
            loop {
                self.top_up();
                if let Some((m, received)) = self.buffer.pop_front() {
                    let Some(handle) = m.receipt_handle().map(str::to_owned) else {
                        continue;
                    };
                    // A message of the batch that waited for a free slot:
                    // past its visibility SQS may have handed it out again
                    // (its handle is stale, leave it); past half of it,
                    // keep it hidden for the delivery ahead.
                    let waited = received.elapsed();
                    if waited >= self.shared.visibility {
                        continue;
                    }
                    if waited > self.shared.visibility / 2 {
                        let secs = hold_secs(self.shared.visibility, waited);
                        self.shared.change_visibility(&handle, secs).await?;
                    }
                    let delivery = message_delivery(&self.shared.queue_url, &m);
                    return Ok(Some(Incoming {
                        delivery,
                        ack: Box::new(MessageAcker {
                            shared: Arc::clone(&self.shared),
                            handle,
                            received,
                        }),
                    }));
                }
                // Cancel-safe: a receive that finished is taken only here.
                match self.receives.next().await {
                    Some(Ok(Ok(messages))) => self.buffer.extend(messages),
                    Some(Ok(Err(e))) => return Err(e),
                    Some(Err(e)) => {
                        return Err(BrokerError::Op {
                            broker: BROKER,
                            op: format!("ReceiveMessage from {}", self.shared.queue_url),
                            why: format!("the receive's task ended: {e}"),
                        });
                    }
                    None => {}
                }
            }
        })
    }
}

struct MessageAcker {
    shared: Arc<Shared>,
    handle: String,
    received: Instant,
}

impl Acker for MessageAcker {
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), BrokerError>> {
        // Called once the message's outcome is durable: it shares a
        // `DeleteMessageBatch` with the deletes asked for within
        // [`BATCH_WAIT`].
        Box::pin(async move { self.shared.deletes.call(self.handle, 0).await })
    }

    fn progress(&self) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(async move {
            let secs = hold_secs(self.shared.visibility, self.received.elapsed());
            self.shared.change_visibility(&self.handle, secs).await
        })
    }

    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), BrokerError>> {
        Box::pin(async move { self.shared.change_visibility(&self.handle, 0).await })
    }

    fn hold(self: Box<Self>, wait: Duration) -> BoxFuture<'static, Result<(), BrokerError>> {
        Box::pin(async move {
            let secs = hold_secs(wait, self.received.elapsed());
            self.shared.change_visibility(&self.handle, secs).await
        })
    }
}

/// The visibility timeout that keeps a message away for `wait` (rounded up
/// to whole seconds), at most what is left of the 12 hours SQS allows from
/// its receive (`elapsed` ago, with a second to spare).
pub fn hold_secs(wait: Duration, elapsed: Duration) -> i32 {
    let left = VISIBILITY_MAX
        .saturating_sub(elapsed)
        .saturating_sub(Duration::from_secs(1));
    let wait = wait.min(left);
    let secs = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    i32::try_from(secs).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(attrs: &[(&str, &str)], system: &[(MessageSystemAttributeName, &str)]) -> Message {
        let mut b = Message::builder()
            .message_id("sqs-1")
            .receipt_handle("h")
            .body("{\"n\": 1}");
        for (k, v) in attrs {
            b = b.message_attributes(*k, string_attribute(v).unwrap());
        }
        for (k, v) in system {
            b = b.attributes(k.clone(), *v);
        }
        b.build()
    }

    #[test]
    fn a_message_maps_onto_a_delivery() {
        let m = message(
            &[("message_id", "order-7"), ("tenant", "acme")],
            &[
                (MessageSystemAttributeName::ApproximateReceiveCount, "3"),
                (MessageSystemAttributeName::MessageGroupId, "g-1"),
                (MessageSystemAttributeName::SentTimestamp, "1700000000000"),
            ],
        );
        let d = message_delivery("http://q/orders.fifo", &m);
        assert_eq!(d.message_id, "order-7");
        assert_eq!(d.body, b"{\"n\": 1}");
        assert_eq!(d.broker_prior, 2);
        assert!(d.redelivered);
        assert_eq!(d.header("tenant").as_deref(), Some("acme"));
        assert_eq!(
            d.position,
            json!({"message_id": "sqs-1", "receive_count": 3, "group_id": "g-1", "sent_at_ms": 1_700_000_000_000_i64})
        );
        let first = message_delivery("q", &message(&[], &[]));
        assert_eq!(
            (first.message_id.as_str(), first.broker_prior),
            ("sqs-1", 0)
        );
    }

    #[test]
    fn lazarets_fields_travel_in_one_attribute_both_ways() {
        let msg = Republish {
            queue: "q".into(),
            body: b"{}".to_vec(),
            content_type: None,
            headers: json!({"tenant": "acme", "x-lazaret-message-id": "order-7", "x-lazaret-attempt": "0", "n": 3,
                            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"})
                .as_object()
                .cloned()
                .unwrap(),
            message_id: "order-7".into(),
            dedup_id: "order-7:redrive:1".into(),
            position: Value::Null,
        };
        let attrs = publish_attributes(&msg).unwrap();
        let mut names: Vec<&str> = attrs.keys().map(String::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, vec!["lazaret", "n", "tenant"]);
        assert_eq!(attrs["n"].data_type(), "Number");
        let mut b = Message::builder().message_id("sqs-2").body("{}");
        for (k, v) in attrs {
            b = b.message_attributes(k, v);
        }
        let mut d = message_delivery("q", &b.build());
        d.resolve_id();
        assert_eq!(d.message_id, "order-7");
        assert_eq!(d.attempt_header(), Some(b"0".to_vec()));
        assert!(!d.headers.contains_key("lazaret"));
        // The trace context rides in `lazaret` too, and comes out validated.
        assert_eq!(
            d.traceparent("q")
                .map(|t| t.trace_id().to_owned())
                .as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
    }

    #[test]
    fn more_than_ten_attributes_are_refused_with_the_names() {
        let mut headers = Map::new();
        for i in 0..10 {
            headers.insert(format!("h{i}"), Value::from("v"));
        }
        let msg = Republish {
            queue: "q".into(),
            body: vec![],
            content_type: None,
            headers,
            message_id: "m".into(),
            dedup_id: "d".into(),
            position: Value::Null,
        };
        let err = publish_attributes(&msg).unwrap_err();
        assert!(err.contains("11"), "{err}");
    }

    #[test]
    fn holds_stop_short_of_twelve_hours_from_the_receive() {
        assert_eq!(hold_secs(Duration::from_millis(300), Duration::ZERO), 1);
        assert_eq!(
            hold_secs(Duration::from_secs(60), Duration::from_secs(5)),
            60
        );
        assert_eq!(
            hold_secs(Duration::from_secs(24 * 3600), Duration::from_secs(100)),
            43_200 - 101
        );
        assert_eq!(hold_secs(Duration::from_secs(10), VISIBILITY_MAX), 0);
    }

    #[test]
    fn the_redrive_policy_says_max_receives() {
        assert_eq!(
            max_receive_count(
                r#"{"deadLetterTargetArn":"arn:aws:sqs:us-east-1:1:dlq","maxReceiveCount":5}"#
            ),
            Some(5)
        );
        assert_eq!(max_receive_count(r#"{"maxReceiveCount":"3"}"#), Some(3));
        assert_eq!(max_receive_count("nonsense"), None);
        assert_eq!(dedup_id("x").len(), 64);
    }
}
