//! The Kafka adapter: a source's `queue` is a topic, its `group` a
//! consumer group, its `url` the bootstrap servers (`host:port`, several
//! separated by commas). The client is librdkafka through `rdkafka`, its
//! bundled copy built with gcc and make (`docs/brokers.md` says why).
//!
//! # Guard mode
//!
//! lazaret joins the consumer group and reads the topic's partitions. A
//! record maps onto a delivery as the contract's table says:
//!
//! - body: the record value (none: empty);
//! - message id: the header `message_id`, else `<topic>-<partition>-<offset>`
//!   (`x-lazaret-message-id` wins, as for every broker);
//! - content type: the header `content-type` (or `content_type`,
//!   `contentType`);
//! - headers: the record headers (a value that is not UTF-8 as
//!   `{"base64": …}`, a null value as `null`), and the record key,
//!   percent-encoded, in `Lazaret-Kafka-Key`;
//! - the broker's count of earlier deliveries: none (Kafka keeps no such
//!   count);
//! - position: `{"topic", "partition", "offset", "timestamp"}` (the
//!   timestamp in milliseconds since the epoch, when the record has one).
//!
//! **Offsets.** Kafka acknowledges by committing an offset, which settles
//! every record before it at once. Records of a partition run side by side
//! (up to `concurrency`) and finish in any order, so lazaret keeps, per
//! partition, the records handed out and not yet settled, and commits an
//! offset only once *every* record before it was settled: acknowledged
//! after a success, or after lazaret's durable write of its held retry or
//! dead letter. A failing record never stalls its partition (its retry
//! waits in lazaret's store, the records behind it go on), and a crash or a
//! rebalance at any point resumes from an offset before which everything is
//! settled. A record handed back (lazaret could not record its outcome)
//! stays unsettled: the consumer is reopened, and reads again from the
//! committed offset.
//!
//! Kafka cannot tell a first delivery from a second, so every record is
//! looked up in lazaret's store before delivery (a crash between the write
//! and the commit is recognised that way), except one that lazaret
//! republished itself (a redrive, with `x-lazaret-attempt`): its dead
//! letter is removed only after the publish is confirmed, so the lookup
//! would find it and drop the copy.
//!
//! A held retry outlives its record's acknowledgement, and may finish
//! before the committed offset passes the record (a record before it still
//! runs). Were it then forgotten, a crash would make the group read the
//! record again and the handler get it from attempt 1 after its later
//! attempts. So the runtime asks [`Broker::may_come_again`] (here: is the
//! group's committed offset of the partition past the record?) and keeps a
//! trace of the finished retry in the store until it is; the record read
//! again meanwhile is recognised and only acknowledged.
//!
//! # Watch mode
//!
//! `queue` is a dead-letter topic that Spring Kafka's
//! `DeadLetterPublishingRecoverer` fills. Its headers
//! `kafka_dlt-original-topic`, `-original-partition` and `-original-offset`
//! (big-endian binary integers) and `-original-timestamp` say where the
//! record came from; `kafka_dlt-exception-fqcn`, `-exception-cause-fqcn`,
//! `-exception-message` and `-exception-stacktrace` why it failed. It is
//! taken in with reason `listener_failed`, the error kind the cause's class
//! (more telling than `ListenerExecutionFailedException`), else the
//! exception's. A record without these headers is taken in as `rejected`.
//!
//! # Redrive
//!
//! A redrive produces the record to `redrive_to`, else its original topic,
//! with the same key (`Lazaret-Kafka-Key`, decoded), partitioned as Java
//! clients do (`murmur2_random`: murmur2 of the key, see [`java_partition`]),
//! with its headers minus the broker's own (`kafka_dlt-*`) plus
//! `x-lazaret-message-id` and `x-lazaret-attempt: 0`, and returns once all
//! in-sync replicas have it (`acks=all`).
//!
//! Kafka enforces no delivery limit of its own, so there is nothing to warn
//! about at start.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use futures_util::future::BoxFuture;
use lazaret_core::{DeadLetterReason, Failure, Timestamp};
use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, percent_decode_str};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{
    BaseConsumer, CommitMode, Consumer as _, ConsumerContext, Rebalance, StreamConsumer,
};
use rdkafka::message::{BorrowedMessage, Header, Headers as _, Message as _, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use serde_json::{Map, Value, json};
use tokio::sync::Notify;

use crate::broker::{Acker, Broker, BrokerError, Consumer, Incoming};
use crate::message::TakenIn;
use crate::message::{ATTEMPT_HEADER, Delivery, Republish, bytes_value, header_text, value_bytes};
use crate::spec::SourceSpec;

const BROKER: &str = "kafka";

/// The header that carries a record's key, percent-encoded.
pub const KEY_HEADER: &str = "Lazaret-Kafka-Key";
/// What `Lazaret-Kafka-Key` escapes: all but letters, digits and the
/// URL-unreserved `-._~`.
const KEY_ESCAPED: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'-')
    .remove(b'.')
    .remove(b'_')
    .remove(b'~');
/// The header that names a record's message id.
const MESSAGE_ID_HEADER: &str = "message_id";
/// The headers that hold the content type, the first present wins.
const CONTENT_TYPE_HEADERS: [&str; 3] = ["content-type", "content_type", "contentType"];
/// The prefix of Spring Kafka's dead-letter headers.
const DLT_PREFIX: &str = "kafka_dlt-";

/// How long connecting (the first metadata request) may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a redrive's produce may wait for `acks=all`.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(30);
/// The group session timeout: how soon a dead lazaret's partitions go to
/// another member.
const SESSION_TIMEOUT: Duration = Duration::from_secs(10);
/// The shortest time the runtime may go without asking for a record before
/// the group takes its partitions away (librdkafka's default).
const MAX_POLL_INTERVAL_FLOOR: Duration = Duration::from_secs(300);

/// Opens the adapter: checks that the bootstrap servers answer, and makes
/// the producer redrives use.
pub async fn connect(spec: &SourceSpec) -> Result<Box<dyn Broker>, BrokerError> {
    let servers = bootstrap_servers(&spec.url)?;
    if spec.group.trim().is_empty() {
        return Err(BrokerError::Config(format!(
            "source {:?}: a Kafka source needs a consumer group id in `group` (default \"lazaret\")",
            spec.name
        )));
    }
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &servers)
        .set("acks", "all")
        // Java's keyed partitioning: murmur2 of the key; random without one.
        .set("partitioner", "murmur2_random")
        .set(
            "message.timeout.ms",
            PUBLISH_TIMEOUT.as_millis().to_string(),
        )
        .create()
        .map_err(|e| connect_error(&servers, &e))?;
    let probe = producer.clone();
    tokio::task::spawn_blocking(move || probe.client().fetch_metadata(None, CONNECT_TIMEOUT))
        .await
        .map_err(|e| connect_error(&servers, &e))?
        .map_err(|e| connect_error(&servers, &e))?;
    Ok(Box::new(Kafka {
        spec: spec.clone(),
        servers,
        producer,
        offsets: Mutex::new(None),
    }))
}

/// The bootstrap servers a source's `url` names: `host:port[,host:port…]`,
/// a `kafka://` prefix allowed.
pub fn bootstrap_servers(url: &str) -> Result<String, BrokerError> {
    let s = url.trim();
    let s = s
        .strip_prefix("kafka://")
        .unwrap_or(s)
        .trim_end_matches('/');
    let ok = !s.is_empty()
        && !s.contains("://")
        && s.split(',')
            .all(|hp| matches!(hp.trim().rsplit_once(':'), Some((h, p)) if !h.is_empty() && p.parse::<u16>().is_ok()));
    if ok {
        Ok(s.to_owned())
    } else {
        Err(BrokerError::Config(format!(
            "a Kafka source's url is the bootstrap servers as host:port (several separated by commas), e.g. \"127.0.0.1:9092\", not {url:?}"
        )))
    }
}

fn connect_error(servers: &str, e: &dyn fmt::Display) -> BrokerError {
    BrokerError::Connect {
        broker: BROKER,
        url: servers.to_owned(),
        why: e.to_string(),
    }
}

/// The Kafka broker of one source.
pub struct Kafka {
    spec: SourceSpec,
    servers: String,
    producer: FutureProducer,
    /// A client of the group that never joins it, made at first use: it
    /// reads the group's committed offsets ([`Broker::may_come_again`]).
    offsets: Mutex<Option<Arc<BaseConsumer>>>,
}

impl Kafka {
    /// The client that reads the group's committed offsets.
    fn offsets(&self) -> Result<Arc<BaseConsumer>, BrokerError> {
        let mut slot = self.offsets.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = slot.as_ref() {
            return Ok(Arc::clone(c));
        }
        let c: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &self.servers)
            .set("group.id", &self.spec.group)
            .set("enable.auto.commit", "false")
            .create()
            .map_err(|e| connect_error(&self.servers, &e))?;
        Ok(Arc::clone(slot.insert(Arc::new(c))))
    }
}

/// A record's topic, partition and offset, from its delivery's position.
fn coordinates(position: &Value) -> Option<(String, i32, i64)> {
    Some((
        position.get("topic")?.as_str()?.to_owned(),
        i32::try_from(position.get("partition")?.as_i64()?).ok()?,
        position.get("offset")?.as_i64()?,
    ))
}

impl fmt::Debug for Kafka {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Kafka")
            .field("servers", &self.servers)
            .field("topic", &self.spec.queue)
            .field("group", &self.spec.group)
            .finish_non_exhaustive()
    }
}

impl Broker for Kafka {
    fn kind(&self) -> &'static str {
        BROKER
    }

    /// Joins the group and subscribes to the topic. A group that never
    /// committed starts at the earliest record: records produced before
    /// lazaret first started are processed, not skipped.
    fn consume(&self) -> BoxFuture<'_, Result<Box<dyn Consumer>, BrokerError>> {
        Box::pin(async move {
            let setup = Setup {
                servers: self.servers.clone(),
                group: self.spec.group.clone(),
                topic: self.spec.queue.clone(),
                poll_interval: (self.spec.delivery_timeout * 2).max(MAX_POLL_INTERVAL_FLOOR),
            };
            let (consumer, shared) = setup.open()?;
            Ok(Box::new(TopicConsumer {
                consumer: Some(consumer),
                shared,
                setup,
                short_since: None,
                described_at: None,
                retiring: Vec::new(),
            }) as Box<dyn Consumer>)
        })
    }

    fn publish(&self, msg: Republish) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(async move {
            let (key, headers) = produce_parts(&msg);
            let mut owned = OwnedHeaders::new_with_capacity(headers.len());
            for (name, value) in &headers {
                owned = owned.insert(Header {
                    key: name.as_str(),
                    value: value.as_deref(),
                });
            }
            let mut record = FutureRecord::to(&msg.queue)
                .payload(msg.body.as_slice())
                .headers(owned);
            if let Some(k) = &key {
                record = record.key(k.as_slice());
            }
            match self.producer.send(record, PUBLISH_TIMEOUT).await {
                Ok(_) => Ok(()),
                Err((e, _)) => Err(BrokerError::NotConfirmed {
                    broker: BROKER,
                    queue: msg.queue.clone(),
                    why: e.to_string(),
                }),
            }
        })
    }

    /// Until the group's committed offset of the record's partition is
    /// past it: asked of the group coordinator (an `OffsetFetch`, by a
    /// client that does not join the group), so any node can tell,
    /// whichever holds the partition.
    fn may_come_again(&self, position: &Value) -> BoxFuture<'_, Result<bool, BrokerError>> {
        let at = coordinates(position);
        Box::pin(async move {
            let Some((topic, partition, offset)) = at else {
                return Ok(false);
            };
            let failed = |e: &dyn fmt::Display| BrokerError::Op {
                broker: BROKER,
                op: format!("read the committed offset of topic {topic} partition {partition}"),
                why: e.to_string(),
            };
            let consumer = self.offsets()?;
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition(&topic, partition);
            let committed = tokio::task::spawn_blocking(move || {
                consumer.committed_offsets(tpl, CONNECT_TIMEOUT)
            })
            .await
            .map_err(|e| failed(&e))?
            .map_err(|e| failed(&e))?;
            let passed = committed
                .find_partition(&topic, partition)
                .is_some_and(|e| matches!(e.offset(), Offset::Offset(c) if c > offset));
            Ok(!passed)
        })
    }

    fn interpret<'a>(&'a self, d: &'a Delivery) -> BoxFuture<'a, Result<TakenIn, BrokerError>> {
        Box::pin(async move { Ok(interpret(d)) })
    }
}

/// What a consumer, its context and its ackers share.
struct Shared {
    topic: String,
    tracker: Mutex<Tracker>,
    /// The offset last committed per partition; held while committing, so
    /// commits of one consumer never overtake each other.
    commits: tokio::sync::Mutex<HashMap<i32, i64>>,
    /// A record was handed back: reopen the consumer.
    rewind: AtomicBool,
    /// Wakes a waiting `next` when `rewind` turns true.
    wake: Notify,
    /// The group gave this consumer an assignment (empty or not): its
    /// join completed.
    assigned: AtomicBool,
}

impl Shared {
    fn tracker(&self) -> std::sync::MutexGuard<'_, Tracker> {
        self.tracker.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Follows the group's rebalances: a partition taken away forgets its
/// unsettled records (their acknowledgements then commit nothing: the new
/// owner reads them again from the committed offset).
struct Ctx {
    shared: Arc<Shared>,
}

impl ClientContext for Ctx {}

impl ConsumerContext for Ctx {
    fn pre_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(tpl) = rebalance {
            let mut t = self.shared.tracker();
            for e in tpl.elements() {
                t.revoke(e.partition());
            }
        }
    }

    fn post_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(tpl) = rebalance {
            let mut t = self.shared.tracker();
            let mut partitions = Vec::new();
            for e in tpl.elements() {
                t.assign(e.partition());
                partitions.push(e.partition());
            }
            partitions.sort_unstable();
            self.shared.assigned.store(true, Ordering::SeqCst);
            // Which node reads which partition is what an operator asks
            // first when several nodes share a group.
            tracing::info!(topic = %self.shared.topic, "the group assigned this node partitions {partitions:?} of topic {}", self.shared.topic);
        }
    }
}

/// Per partition, the records handed out and not yet settled, and so the
/// offset that may be committed: the contiguous settled prefix.
#[derive(Debug, Default)]
pub struct Tracker {
    partitions: HashMap<i32, PartitionState>,
    /// The last generation given out; a partition's generation changes at
    /// every assignment, so an acknowledgement from before a rebalance
    /// commits nothing.
    generation: u64,
}

#[derive(Debug)]
struct PartitionState {
    generation: u64,
    /// Offsets handed out, in order, and whether each is settled.
    open: BTreeMap<i64, bool>,
    /// The offset to commit: every record before it is settled.
    commit_to: Option<i64>,
}

impl Tracker {
    fn fresh(&mut self) -> PartitionState {
        self.generation += 1;
        PartitionState {
            generation: self.generation,
            open: BTreeMap::new(),
            commit_to: None,
        }
    }

    /// The partition was (re)assigned: it starts afresh.
    pub fn assign(&mut self, partition: i32) {
        let s = self.fresh();
        self.partitions.insert(partition, s);
    }

    /// The partition was taken away.
    pub fn revoke(&mut self, partition: i32) {
        self.partitions.remove(&partition);
    }

    /// A record was handed out; returns its partition's generation.
    pub fn handed_out(&mut self, partition: i32, offset: i64) -> u64 {
        if !self.partitions.contains_key(&partition) {
            let s = self.fresh();
            self.partitions.insert(partition, s);
        }
        let p = self
            .partitions
            .get_mut(&partition)
            .expect("the partition was just inserted");
        p.open.insert(offset, false);
        p.generation
    }

    /// A record was settled; returns the offset to commit when the settled
    /// prefix grew (`None` when a record before it is still open, or the
    /// partition was reassigned since).
    pub fn settled(&mut self, partition: i32, generation: u64, offset: i64) -> Option<i64> {
        let p = self.partitions.get_mut(&partition)?;
        if p.generation != generation {
            return None;
        }
        if let Some(done) = p.open.get_mut(&offset) {
            *done = true;
        }
        let mut grew = false;
        while let Some(entry) = p.open.first_entry() {
            if !*entry.get() {
                break;
            }
            let (o, _) = entry.remove_entry();
            p.commit_to = Some(o + 1);
            grew = true;
        }
        if grew { p.commit_to } else { None }
    }

    /// The offset to commit now for a partition of this generation.
    pub fn commit_to(&self, partition: i32, generation: u64) -> Option<i64> {
        self.partitions
            .get(&partition)
            .filter(|p| p.generation == generation)
            .and_then(|p| p.commit_to)
    }
}

/// How a source's group consumer is made; kept to make it again.
struct Setup {
    servers: String,
    group: String,
    topic: String,
    poll_interval: Duration,
}

impl Setup {
    /// A new member of the group, subscribed to the topic (it joins the
    /// group once polled).
    fn open(&self) -> Result<(Arc<StreamConsumer<Ctx>>, Arc<Shared>), BrokerError> {
        let shared = Arc::new(Shared {
            topic: self.topic.clone(),
            tracker: Mutex::new(Tracker::default()),
            commits: tokio::sync::Mutex::new(HashMap::new()),
            rewind: AtomicBool::new(false),
            wake: Notify::new(),
            assigned: AtomicBool::new(false),
        });
        let consumer: StreamConsumer<Ctx> = ClientConfig::new()
            .set("bootstrap.servers", &self.servers)
            .set("group.id", &self.group)
            .set("enable.auto.commit", "false")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set(
                "session.timeout.ms",
                SESSION_TIMEOUT.as_millis().to_string(),
            )
            .set(
                "max.poll.interval.ms",
                self.poll_interval.as_millis().to_string(),
            )
            .create_with_context(Ctx {
                shared: Arc::clone(&shared),
            })
            .map_err(|e| connect_error(&self.servers, &e))?;
        consumer
            .subscribe(&[self.topic.as_str()])
            .map_err(|e| BrokerError::Op {
                broker: BROKER,
                op: format!("subscribe to topic {}", self.topic),
                why: e.to_string(),
            })?;
        Ok((Arc::new(consumer), shared))
    }
}

/// How long a consumer may hold fewer partitions than the group owes it
/// (see [`partitions_owed`]) before it joins again as a new member: twice
/// the session timeout, so a member that died has been expired and a
/// rebalance had time to finish.
const STALL_AFTER: Duration = Duration::from_secs(20);
/// How often a consumer waiting for a record looks whether it is stalled.
const STALL_CHECK: Duration = Duration::from_secs(2);
/// How often a consumer that holds fewer than all of the topic's
/// partitions asks the group coordinator how many the group owes it.
const DESCRIBE_EVERY: Duration = Duration::from_secs(10);
/// How long the group may take to describe itself for that.
const DESCRIBE_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a replaced member stays in the group at most, waiting for its
/// successor's join to complete.
const RETIRE_MAX: Duration = Duration::from_secs(30);

/// How many partitions of a topic of `partitions` a member of a group
/// that its coordinator describes as `state` with `members` members is
/// owed. A `Stable` group owes each member at least `partitions /
/// members`: the range and round-robin assignors (librdkafka's default)
/// and the sticky ones spread a topic's partitions evenly, so with more
/// members than partitions some members are idle by design (owed 0). A
/// group that is not `Stable` (a rebalance that has not finished, or a
/// coordinator that lost its state) owes a member that holds nothing one
/// partition. The count assumes the group's members all read this topic,
/// as the nodes of one lazaret source do.
pub fn partitions_owed(state: &str, members: usize, partitions: usize) -> usize {
    if partitions == 0 {
        0
    } else if state != "Stable" {
        1
    } else {
        partitions / members.max(1)
    }
}

/// Reads the group's records one at a time.
///
/// **Stalled groups.** A member that holds fewer partitions than the group
/// owes it ([`partitions_owed`]) for [`STALL_AFTER`] joins again as a new
/// member, making the new one before leaving with the
/// old (which stays in the group, not polled, until the new one's join
/// completes or [`RETIRE_MAX`]). Against a Kafka broker this never happens
/// in a healthy group, and when it does (a rebalance stuck on a member
/// that does not rejoin) a new member only joins the rebalance. It is what
/// gets a group on tansu 0.6 going again after its coordinator lost track
/// of a member (after a broker pause past the session timeout, or a
/// member killed while the group was stable): tansu keeps an expired
/// leader as the group's leader, so no join completes until two members'
/// requests overlap and it reloads the group; and it keeps an expired
/// member's partitions assigned to it while the group stays stable. A new
/// member makes it rebalance (`docs/reliability.md`, "Broker faults under
/// the guard").
struct TopicConsumer {
    consumer: Option<Arc<StreamConsumer<Ctx>>>,
    shared: Arc<Shared>,
    setup: Setup,
    /// Since when the consumer holds fewer partitions than the group owes
    /// it, as last described.
    short_since: Option<Instant>,
    /// When the group was last described for that.
    described_at: Option<Instant>,
    /// Members replaced by a new one, and when each must leave at the
    /// latest.
    retiring: Vec<(Arc<StreamConsumer<Ctx>>, Instant)>,
}

/// Closes a consumer (it leaves the group), which waits on the broker: on
/// a multi-threaded runtime in place (the consumer is gone when this
/// returns), elsewhere on a blocking thread.
fn close(c: Arc<StreamConsumer<Ctx>>) {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(move || drop(c));
        }
        Ok(h) => {
            h.spawn_blocking(move || drop(c));
        }
        Err(_) => drop(c),
    }
}

impl Drop for TopicConsumer {
    fn drop(&mut self) {
        for (c, _) in self.retiring.drain(..) {
            close(c);
        }
        if let Some(c) = self.consumer.take() {
            close(c);
        }
    }
}

impl TopicConsumer {
    /// Lets replaced members leave once the new member's join completed,
    /// or at their deadline.
    fn retire(&mut self) {
        if self.retiring.is_empty() {
            return;
        }
        let joined = self.shared.assigned.load(Ordering::SeqCst);
        let now = Instant::now();
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.retiring)
            .into_iter()
            .partition(|(_, until)| joined || now >= *until);
        self.retiring = kept;
        for (c, _) in gone {
            tokio::task::spawn_blocking(move || drop(c));
        }
    }

    /// Looks whether the consumer is stalled, and if so joins again as a
    /// new member (the old one retiring).
    async fn look(&mut self) -> Result<(), BrokerError> {
        let Some(consumer) = self.consumer.clone() else {
            return Ok(());
        };
        let now = Instant::now();
        if !self.retiring.is_empty()
            || self
                .described_at
                .is_some_and(|at| now.duration_since(at) < DESCRIBE_EVERY)
        {
            return Ok(());
        }
        self.described_at = Some(now);
        let (group, topic) = (self.setup.group.clone(), self.setup.topic.clone());
        let c = Arc::clone(&consumer);
        let described = tokio::task::spawn_blocking(move || {
            let held = c.assignment()?.count();
            let meta = c.fetch_metadata(Some(&topic), DESCRIBE_TIMEOUT)?;
            let partitions = meta
                .topics()
                .iter()
                .find(|t| t.name() == topic)
                .map_or(0, |t| t.partitions().len());
            if held >= partitions {
                return Ok((held, "Stable".to_owned(), 1, partitions));
            }
            let groups = c.fetch_group_list(Some(&group), DESCRIBE_TIMEOUT)?;
            let g = groups.groups().iter().find(|g| g.name() == group);
            Ok::<_, rdkafka::error::KafkaError>((
                held,
                g.map_or_else(|| "Dead".to_owned(), |g| g.state().to_owned()),
                g.map_or(0, |g| g.members().len()),
                partitions,
            ))
        })
        .await;
        let (held, state, members, partitions) = match described {
            Ok(Ok(d)) => d,
            Ok(Err(e)) => {
                tracing::debug!(topic = %self.setup.topic, "cannot describe group {}: {e}", self.setup.group);
                return Ok(());
            }
            Err(e) => {
                tracing::debug!(topic = %self.setup.topic, "cannot describe group {}: {e}", self.setup.group);
                return Ok(());
            }
        };
        let owed = partitions_owed(&state, members, partitions);
        if held >= owed {
            self.short_since = None;
            return Ok(());
        }
        let since = *self.short_since.get_or_insert(now);
        if now.duration_since(since) < STALL_AFTER {
            return Ok(());
        }
        tracing::warn!(
            topic = %self.setup.topic,
            "this node has held {held} partitions of topic {} for {} s while group {} ({state}, {members} members, {partitions} partitions) owes it {owed}; joining the group again as a new member",
            self.setup.topic,
            now.duration_since(since).as_secs(),
            self.setup.group
        );
        let (fresh, shared) = self.setup.open()?;
        self.retiring.push((consumer, now + RETIRE_MAX));
        self.consumer = Some(fresh);
        self.shared = shared;
        self.short_since = None;
        Ok(())
    }
}

impl Consumer for TopicConsumer {
    fn next(&mut self) -> BoxFuture<'_, Result<Option<Incoming>, BrokerError>> {
        Box::pin(async move {
            loop {
                self.retire();
                let shared = Arc::clone(&self.shared);
                let Some(consumer) = self.consumer.clone() else {
                    return Ok(None);
                };
                let rewind = || {
                    BrokerError::Op {
                    broker: BROKER,
                    op: format!("consume from topic {}", shared.topic),
                    why: "a record was handed back undelivered; reading the topic again from the committed offsets".into(),
                }
                };
                if shared.rewind.load(Ordering::SeqCst) {
                    return Err(rewind());
                }
                let msg = tokio::select! {
                    m = consumer.recv() => m,
                    _ = shared.wake.notified() => return Err(rewind()),
                    () = tokio::time::sleep(STALL_CHECK) => {
                        self.look().await?;
                        continue;
                    }
                };
                let msg = msg.map_err(|e| BrokerError::Op {
                    broker: BROKER,
                    op: format!("consume from topic {}", shared.topic),
                    why: e.to_string(),
                })?;
                let delivery = message_delivery(&msg);
                let (partition, offset) = (msg.partition(), msg.offset());
                let generation = shared.tracker().handed_out(partition, offset);
                return Ok(Some(Incoming {
                    delivery,
                    ack: Box::new(RecordAcker {
                        consumer: Arc::downgrade(&consumer),
                        shared: Arc::clone(&shared),
                        partition,
                        offset,
                        generation,
                    }),
                }));
            }
        })
    }
}

/// Settles one record.
struct RecordAcker {
    /// Weak: a consumer the runtime dropped leaves the group now, not when
    /// its last record is settled.
    consumer: Weak<StreamConsumer<Ctx>>,
    shared: Arc<Shared>,
    partition: i32,
    offset: i64,
    generation: u64,
}

impl Acker for RecordAcker {
    /// Marks the record settled and commits the partition's settled prefix
    /// when it grew (a synchronous commit: the acknowledgement returns once
    /// the broker has the offset). After a rebalance or once the consumer
    /// is gone nothing is committed: the record is read again and
    /// recognised.
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), BrokerError>> {
        Box::pin(async move {
            let s = &self.shared;
            let grew = s
                .tracker()
                .settled(self.partition, self.generation, self.offset);
            if grew.is_none() {
                return Ok(());
            }
            let Some(consumer) = self.consumer.upgrade() else {
                return Ok(());
            };
            let mut commits = s.commits.lock().await;
            // Read again under the lock: a later acknowledgement may have
            // grown the prefix further meanwhile.
            let Some(to) = s.tracker().commit_to(self.partition, self.generation) else {
                return Ok(());
            };
            if commits.get(&self.partition).is_some_and(|&c| c >= to) {
                return Ok(());
            }
            let mut tpl = TopicPartitionList::new();
            tpl.add_partition_offset(&s.topic, self.partition, Offset::Offset(to))
                .map_err(|e| commit_error(s, self.partition, to, &e))?;
            let committed =
                tokio::task::spawn_blocking(move || consumer.commit(&tpl, CommitMode::Sync))
                    .await
                    .map_err(|e| commit_error(s, self.partition, to, &e))?;
            committed.map_err(|e| commit_error(s, self.partition, to, &e))?;
            commits.insert(self.partition, to);
            crate::failpoint::fail_point!("guard::kafka_after_commit");
            Ok(())
        })
    }

    /// Kafka has no "give back": the record stays unsettled (no offset past
    /// it is committed) and the consumer is reopened, which reads it again
    /// from the committed offset.
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), BrokerError>> {
        Box::pin(async move {
            self.shared.rewind.store(true, Ordering::SeqCst);
            self.shared.wake.notify_one();
            Ok(())
        })
    }
}

fn commit_error(s: &Shared, partition: i32, offset: i64, e: &dyn fmt::Display) -> BrokerError {
    BrokerError::Op {
        broker: BROKER,
        op: format!(
            "commit offset {offset} of topic {} partition {partition}",
            s.topic
        ),
        why: e.to_string(),
    }
}

fn message_delivery(m: &BorrowedMessage<'_>) -> Delivery {
    let headers: Vec<(String, Option<Vec<u8>>)> = m
        .headers()
        .map(|hs| {
            hs.iter()
                .map(|h| (h.key.to_owned(), h.value.map(<[u8]>::to_vec)))
                .collect()
        })
        .unwrap_or_default();
    record_delivery(&Record {
        topic: m.topic(),
        partition: m.partition(),
        offset: m.offset(),
        timestamp: m.timestamp().to_millis(),
        key: m.key(),
        headers: &headers,
        value: m.payload(),
    })
}

/// A record header: its name and its value (`None`: a null value).
pub type RecordHeader = (String, Option<Vec<u8>>);

/// A Kafka record, as the mapping needs it.
#[derive(Clone, Copy, Debug)]
pub struct Record<'a> {
    /// Its topic.
    pub topic: &'a str,
    /// Its partition.
    pub partition: i32,
    /// Its offset.
    pub offset: i64,
    /// Its timestamp, milliseconds since the epoch.
    pub timestamp: Option<i64>,
    /// Its key.
    pub key: Option<&'a [u8]>,
    /// Its headers, in order (a name may repeat: the last wins).
    pub headers: &'a [RecordHeader],
    /// Its value.
    pub value: Option<&'a [u8]>,
}

/// A record as a delivery (the module's mapping).
pub fn record_delivery(r: &Record<'_>) -> Delivery {
    let mut headers = Map::new();
    let mut content_type = None;
    for (name, value) in r.headers {
        if content_type.is_none() && CONTENT_TYPE_HEADERS.contains(&name.as_str()) {
            if let Some(v) = value {
                content_type = Some(String::from_utf8_lossy(v).into_owned());
                continue;
            }
        }
        let v = value.as_deref().map_or(Value::Null, bytes_value);
        headers.insert(name.clone(), v);
    }
    if let Some(k) = r.key {
        headers.insert(KEY_HEADER.into(), Value::String(encode_key(k)));
    }
    let message_id = headers
        .get(MESSAGE_ID_HEADER)
        .and_then(header_text)
        .filter(|id| !id.is_empty())
        .unwrap_or_else(|| format!("{}-{}-{}", r.topic, r.partition, r.offset));
    // Only lazaret's own republish (a redrive) is known to be new.
    let republished = headers.contains_key(ATTEMPT_HEADER);
    Delivery {
        message_id,
        body: r.value.map(<[u8]>::to_vec).unwrap_or_default(),
        content_type,
        headers,
        broker_prior: 0,
        redelivered: !republished,
        queue: r.topic.to_owned(),
        position: position(r.topic, r.partition, r.offset, r.timestamp),
    }
}

fn position(topic: &str, partition: i32, offset: i64, timestamp: Option<i64>) -> Value {
    let mut p = json!({ "topic": topic, "partition": partition, "offset": offset });
    if let (Some(ts), Some(m)) = (timestamp, p.as_object_mut()) {
        m.insert("timestamp".into(), json!(ts));
    }
    p
}

/// A key as `Lazaret-Kafka-Key` carries it.
pub fn encode_key(key: &[u8]) -> String {
    percent_encoding::percent_encode(key, KEY_ESCAPED).to_string()
}

/// The key `Lazaret-Kafka-Key` carries.
pub fn decode_key(encoded: &str) -> Vec<u8> {
    percent_decode_str(encoded).collect()
}

/// What a redrive produces besides the value: the key (from
/// `Lazaret-Kafka-Key`) and the headers in order (the content type as
/// `content-type`; a `null` header as a header without a value).
pub fn produce_parts(msg: &Republish) -> (Option<Vec<u8>>, Vec<RecordHeader>) {
    let mut key = None;
    let mut headers = Vec::with_capacity(msg.headers.len() + 1);
    for (name, value) in &msg.headers {
        if name.eq_ignore_ascii_case(KEY_HEADER) {
            key = header_text(value).map(|k| decode_key(&k));
            continue;
        }
        let bytes = match value {
            Value::Null => None,
            v => Some(value_bytes(v)),
        };
        headers.push((name.clone(), bytes));
    }
    if let Some(ct) = &msg.content_type {
        if !headers
            .iter()
            .any(|(n, _)| CONTENT_TYPE_HEADERS.contains(&n.as_str()))
        {
            headers.push(("content-type".into(), Some(ct.clone().into_bytes())));
        }
    }
    (key, headers)
}

/// Java's `Utils.murmur2`, the hash Kafka's Java producer partitions keys
/// by (librdkafka's `murmur2_random` is the same).
pub fn murmur2(data: &[u8]) -> i32 {
    const SEED: u32 = 0x9747_b28c;
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let len = data.len();
    let mut h: u32 = SEED ^ (len as u32);
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        if rest.len() >= 3 {
            h ^= u32::from(rest[2]) << 16;
        }
        if rest.len() >= 2 {
            h ^= u32::from(rest[1]) << 8;
        }
        h ^= u32::from(rest[0]);
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// The partition Java's default partitioner gives a keyed record:
/// `toPositive(murmur2(key)) % partitions`.
pub fn java_partition(key: &[u8], partitions: i32) -> i32 {
    (murmur2(key) & 0x7fff_ffff) % partitions.max(1)
}

/// What a record of a Spring Kafka dead-letter topic says of itself. Pure:
/// the watch runtime files the result.
pub fn interpret(d: &Delivery) -> TakenIn {
    let raw = |suffix: &str| {
        let name = format!("{DLT_PREFIX}{suffix}");
        d.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(&name))
            .filter(|(_, v)| !v.is_null())
            .map(|(_, v)| value_bytes(v))
    };
    let text = |suffix: &str| {
        raw(suffix)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .filter(|t| !t.trim().is_empty())
    };
    let topic = text("original-topic");
    let partition = raw("original-partition")
        .and_then(|b| big_endian(&b))
        .and_then(|p| i32::try_from(p).ok());
    let offset = raw("original-offset").and_then(|b| big_endian(&b));
    let timestamp = raw("original-timestamp").and_then(|b| big_endian(&b));
    let fqcn = text("exception-fqcn");
    let cause = text("exception-cause-fqcn");
    let message = text("exception-message");
    let stacktrace = text("exception-stacktrace");
    let spring = topic.is_some() || fqcn.is_some() || message.is_some();

    let error = spring.then(|| {
        let kind = cause
            .clone()
            .or_else(|| fqcn.clone())
            .unwrap_or_else(|| "listener_failed".into());
        let text = message.clone().unwrap_or_else(|| {
            format!(
                "the listener threw {}",
                fqcn.as_deref().unwrap_or("an exception")
            )
        });
        let mut f = Failure::new(kind, text);
        if let Some(st) = &stacktrace {
            f = f.with_traceback(st.clone());
        }
        f.truncate_to_caps();
        f
    });

    let mut original = d.clone();
    original
        .headers
        .retain(|k, _| !k.to_ascii_lowercase().starts_with(DLT_PREFIX));
    let original_position = match (&topic, partition, offset) {
        (Some(t), Some(p), Some(o)) => Some(position(t, p, o, timestamp)),
        _ => None,
    };
    if let Some(t) = &topic {
        original.queue = t.clone();
    }
    if let Some(pos) = &original_position {
        original.position = pos.clone();
        let named = original
            .headers
            .get(MESSAGE_ID_HEADER)
            .and_then(header_text)
            .is_some_and(|id| !id.is_empty());
        if !named {
            if let (Some(t), Some(p), Some(o)) = (&topic, partition, offset) {
                original.message_id = format!("{t}-{p}-{o}");
            }
        }
    }
    original.broker_prior = 0;
    original.redelivered = false;
    original.resolve_id();
    let first_at = d
        .position
        .get("timestamp")
        .and_then(Value::as_i64)
        .map(Timestamp::from_millis);

    TakenIn {
        reason: spring.then_some(DeadLetterReason::ListenerFailed),
        error,
        original_queue: topic,
        original_position,
        attempts: 0,
        first_at,
        original: Some(original),
    }
}

/// A big-endian integer of 4 or 8 bytes (Spring's binary headers), or its
/// decimal text.
fn big_endian(b: &[u8]) -> Option<i64> {
    match b.len() {
        4 => Some(i64::from(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))),
        8 => Some(i64::from_be_bytes([
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7],
        ])),
        _ => std::str::from_utf8(b).ok()?.trim().parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stable_group_owes_each_member_an_even_share_and_an_unstable_one_a_partition() {
        // tansu after a lost member: a stable group of one member that
        // holds nothing or only its old share, or a group whose join
        // never completes.
        assert_eq!(partitions_owed("Stable", 1, 1), 1);
        assert_eq!(partitions_owed("Stable", 1, 4), 4);
        assert_eq!(partitions_owed("Stable", 2, 4), 2);
        assert_eq!(partitions_owed("Stable", 3, 4), 1);
        assert_eq!(partitions_owed("Unknown", 2, 1), 1);
        assert_eq!(partitions_owed("PreparingRebalance", 3, 4), 1);
        assert_eq!(partitions_owed("Empty", 0, 4), 1);
        // More nodes than partitions: the extra ones are idle by design.
        assert_eq!(partitions_owed("Stable", 2, 1), 0);
        assert_eq!(partitions_owed("Stable", 5, 4), 0);
        // Nothing to hold.
        assert_eq!(partitions_owed("Unknown", 1, 0), 0);
        assert_eq!(partitions_owed("Stable", 0, 0), 0);
    }

    /// `org.apache.kafka.common.utils.UtilsTest.testMurmur2`'s vectors.
    #[test]
    fn murmur2_matches_the_java_clients_test_vectors() {
        let cases: [(&[u8], i32); 6] = [
            (b"21", -973_932_308),
            (b"foobar", -790_332_482),
            (b"a-little-bit-long-string", -985_981_536),
            (b"a-little-bit-longer-string", -1_486_304_829),
            (
                b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58_897_971,
            ),
            (b"abc", 479_470_107),
        ];
        for (key, want) in cases {
            assert_eq!(murmur2(key), want, "{:?}", String::from_utf8_lossy(key));
        }
        assert_eq!(
            java_partition(b"foobar", 6),
            ((-790_332_482i32) & 0x7fff_ffff) % 6
        );
    }

    #[test]
    fn the_settled_prefix_is_what_gets_committed() {
        let mut t = Tracker::default();
        let g = t.handed_out(0, 10);
        assert_eq!(t.handed_out(0, 11), g);
        assert_eq!(t.handed_out(0, 13), g, "a gap (compaction) is no hole");
        assert_eq!(t.settled(0, g, 11), None, "10 is still open");
        assert_eq!(t.settled(0, g, 13), None);
        assert_eq!(t.commit_to(0, g), None);
        assert_eq!(t.settled(0, g, 10), Some(14), "10, 11 and 13 settled");
        let g1 = t.handed_out(1, 0);
        assert_eq!(t.settled(1, g1, 0), Some(1), "partitions are apart");
        assert_eq!(t.commit_to(0, g), Some(14));
    }

    #[test]
    fn a_rebalance_voids_what_was_open() {
        let mut t = Tracker::default();
        let g = t.handed_out(2, 5);
        t.revoke(2);
        assert_eq!(t.settled(2, g, 5), None, "revoked: nothing to commit");
        t.assign(2);
        let g2 = t.handed_out(2, 5);
        assert_ne!(g, g2);
        assert_eq!(t.settled(2, g, 5), None, "an acknowledgement from before");
        assert_eq!(t.settled(2, g2, 5), Some(6));
    }

    fn record<'a>(headers: &'a [(String, Option<Vec<u8>>)], key: Option<&'a [u8]>) -> Record<'a> {
        Record {
            topic: "orders",
            partition: 3,
            offset: 1234,
            timestamp: Some(1_700_000_000_000),
            key,
            headers,
            value: Some(b"{\"id\": 7}"),
        }
    }

    fn h(name: &str, v: &[u8]) -> (String, Option<Vec<u8>>) {
        (name.to_owned(), Some(v.to_vec()))
    }

    #[test]
    fn a_record_maps_onto_a_delivery() {
        let hs = vec![
            h("message_id", b"order-7"),
            h("content-type", b"application/json"),
            h("tenant", b"acme"),
            h("blob", &[0xff, 0x00]),
            ("empty".to_owned(), None),
        ];
        let d = record_delivery(&record(&hs, Some(b"cust 9/\xff")));
        assert_eq!(d.message_id, "order-7");
        assert_eq!(d.body, b"{\"id\": 7}");
        assert_eq!(d.content_type.as_deref(), Some("application/json"));
        assert_eq!(
            Value::Object(d.headers.clone()),
            json!({"message_id": "order-7", "tenant": "acme", "blob": {"base64": "/wA="},
                   "empty": null, "Lazaret-Kafka-Key": "cust%209%2F%FF"})
        );
        assert_eq!(decode_key("cust%209%2F%FF"), b"cust 9/\xff");
        assert_eq!(
            d.position,
            json!({"topic": "orders", "partition": 3, "offset": 1234, "timestamp": 1_700_000_000_000i64})
        );
        assert_eq!((d.broker_prior, d.redelivered), (0, true));

        let d = record_delivery(&record(&[], None));
        assert_eq!(d.message_id, "orders-3-1234", "no header: the coordinates");
        assert!(d.headers.is_empty());

        let hs = vec![
            h("x-lazaret-attempt", b"0"),
            h("x-lazaret-message-id", b"m"),
        ];
        let d = record_delivery(&record(&hs, None));
        assert!(!d.redelivered, "a redrive's copy is new");
    }

    #[test]
    fn a_redrive_keeps_the_key_and_the_headers() {
        let msg = Republish {
            queue: "orders".into(),
            body: b"x".to_vec(),
            content_type: Some("application/json".into()),
            headers: json!({"tenant": "acme", "Lazaret-Kafka-Key": "cust%209", "bin": {"base64": "/wA="}, "nil": null})
                .as_object()
                .cloned()
                .unwrap_or_default(),
            message_id: "m".into(),
            dedup_id: "d".into(),
            position: Value::Null,
        };
        let (key, headers) = produce_parts(&msg);
        assert_eq!(key, Some(b"cust 9".to_vec()));
        let get = |n: &str| headers.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone());
        assert_eq!(get("tenant"), Some(Some(b"acme".to_vec())));
        assert_eq!(get("bin"), Some(Some(vec![0xff, 0x00])));
        assert_eq!(get("nil"), Some(None));
        assert_eq!(
            get("content-type"),
            Some(Some(b"application/json".to_vec()))
        );
        assert_eq!(get(KEY_HEADER), None, "the key travels as the key");
    }

    #[test]
    fn a_spring_dead_letter_says_why_and_where_from() {
        let hs = vec![
            h("message_id", b"order-7"),
            h("kafka_dlt-original-topic", b"orders"),
            h("kafka_dlt-original-partition", &3i32.to_be_bytes()),
            h("kafka_dlt-original-offset", &1234i64.to_be_bytes()),
            h(
                "kafka_dlt-original-timestamp",
                &1_699_999_999_000i64.to_be_bytes(),
            ),
            h(
                "kafka_dlt-exception-fqcn",
                b"org.springframework.kafka.listener.ListenerExecutionFailedException",
            ),
            h(
                "kafka_dlt-exception-cause-fqcn",
                b"java.lang.IllegalStateException",
            ),
            h(
                "kafka_dlt-exception-message",
                b"Listener failed; card expired",
            ),
            h(
                "kafka_dlt-exception-stacktrace",
                b"java.lang.IllegalStateException: card expired\n\tat Shop.pay(Shop.java:42)",
            ),
            h("tenant", b"acme"),
        ];
        let mut dlt = record(&hs, Some(b"cust-9"));
        dlt.topic = "orders.DLT";
        dlt.partition = 0;
        dlt.offset = 5;
        let d = record_delivery(&dlt);
        let t = interpret(&d);
        assert_eq!(t.reason, Some(DeadLetterReason::ListenerFailed));
        let e = t.error.clone().expect("the exception");
        assert_eq!(e.kind.as_str(), "java.lang.IllegalStateException");
        assert_eq!(e.message, "Listener failed; card expired");
        assert!(
            e.traceback
                .as_deref()
                .is_some_and(|t| t.contains("Shop.java:42"))
        );
        assert_eq!(t.original_queue.as_deref(), Some("orders"));
        assert_eq!(
            t.original_position,
            Some(
                json!({"topic": "orders", "partition": 3, "offset": 1234, "timestamp": 1_699_999_999_000i64})
            )
        );
        assert_eq!(t.first_at, Some(Timestamp::from_millis(1_700_000_000_000)));
        let o = t.original.expect("the original");
        assert_eq!(o.message_id, "order-7");
        assert_eq!(o.queue, "orders");
        assert_eq!(
            Value::Object(o.headers),
            json!({"message_id": "order-7", "tenant": "acme", "Lazaret-Kafka-Key": "cust-9"})
        );

        // No message_id header: the original coordinates name it.
        let hs: Vec<_> = hs.into_iter().skip(1).collect();
        let t = interpret(&record_delivery(&record(&hs, None)));
        assert_eq!(
            t.original.map(|o| o.message_id).as_deref(),
            Some("orders-3-1234")
        );
    }

    #[test]
    fn a_record_without_spring_headers_is_rejected() {
        let t = interpret(&record_delivery(&record(&[h("a", b"b")], None)));
        assert_eq!(t.reason, None);
        assert_eq!(t.error, None);
        assert_eq!(t.original_queue, None);
        assert_eq!(big_endian(b"42"), Some(42));
        assert_eq!(big_endian(&[0, 0, 0, 7]), Some(7));
    }

    #[test]
    fn urls_are_bootstrap_servers() {
        assert_eq!(
            bootstrap_servers("127.0.0.1:9092").ok().as_deref(),
            Some("127.0.0.1:9092")
        );
        assert_eq!(
            bootstrap_servers("kafka://a:9092,b:9093/").ok().as_deref(),
            Some("a:9092,b:9093")
        );
        for bad in ["", "amqp://x:1", "localhost", "h:port"] {
            assert!(bootstrap_servers(bad).is_err(), "{bad:?}");
        }
    }
}
