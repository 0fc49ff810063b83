//! The seam every broker adapter implements: consume, acknowledge, keep a
//! message from redelivery while it runs, publish with confirmation. An
//! adapter only moves messages; every decision is the runtime's (and so
//! `lazaret-core`'s).

use std::fmt;
use std::time::Duration;

use futures_util::future::BoxFuture;

use crate::message::TakenIn;
use crate::message::{Delivery, Republish};

/// A broker failure. The runtime reconnects after a consumer's error and
/// never acknowledges a message whose write failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BrokerError {
    /// Connecting, or the connection was lost.
    #[error(
        "cannot reach the {broker} broker at {url}: {why}; check that it runs and that the source's url is right"
    )]
    Connect {
        /// `rabbitmq`, `nats`, `redis`.
        broker: &'static str,
        /// The URL, without its password.
        url: String,
        /// What the client said.
        why: String,
    },
    /// The broker refused or failed an operation.
    #[error("{broker}: {op} failed: {why}")]
    Op {
        /// `rabbitmq`, `nats`, `redis`.
        broker: &'static str,
        /// What was being done (`ack`, `publish to orders`, …).
        op: String,
        /// What the broker said.
        why: String,
    },
    /// A publish was not confirmed (nacked, returned unroutable, or no
    /// confirmation came).
    #[error(
        "{broker}: the publish to {queue} was not confirmed: {why}; nothing was removed from the dead letters"
    )]
    NotConfirmed {
        /// `rabbitmq`, `nats`, `redis`.
        broker: &'static str,
        /// Where it was sent.
        queue: String,
        /// Why.
        why: String,
    },
    /// This build has no adapter for the broker.
    #[error(
        "this lazaret was built without the {0} adapter; build it with the cargo feature \"{0}\" (on by default)"
    )]
    NotBuilt(&'static str),
    /// The source's configuration does not fit the broker.
    #[error("{0}")]
    Config(String),
}

/// A consumed message and the handle that settles it.
pub struct Incoming {
    /// The message.
    pub delivery: Delivery,
    /// Acknowledges it, or keeps it from redelivery while it runs.
    pub ack: Box<dyn Acker>,
}

impl fmt::Debug for Incoming {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Incoming")
            .field("delivery", &self.delivery)
            .finish_non_exhaustive()
    }
}

/// Settles one consumed message.
pub trait Acker: Send + Sync {
    /// Acknowledges the message: the broker forgets it (RabbitMQ ack,
    /// JetStream ack awaited, Redis `XACK`). Called only after lazaret's own
    /// write for the message is durable, or after a success.
    fn ack(self: Box<Self>) -> BoxFuture<'static, Result<(), BrokerError>>;

    /// Keeps the broker from redelivering the message while its handler
    /// still runs (JetStream in-progress ack; a no-op where the broker
    /// never redelivers an unacknowledged message to a live consumer).
    fn progress(&self) -> BoxFuture<'_, Result<(), BrokerError>> {
        Box::pin(async { Ok(()) })
    }

    /// The message's outcome is decided and lazaret is writing it down (a
    /// dead letter, a held retry): its [`Acker::ack`] or
    /// [`Acker::release`] follows as soon as that write is done. RabbitMQ
    /// lets the acks of later deliveries wait for it, to go with it as one
    /// `multiple` frame; a no-op elsewhere.
    fn decided(&self) {}

    /// Whether the broker still holds the message for this acker: `false`
    /// once the channel or connection it came on is gone (RabbitMQ), when
    /// its acknowledgement can only fail and the broker hands the message
    /// out again anyway. The runtime then does not deliver it, so a lost
    /// connection duplicates at most the handler calls already running.
    /// `true` where acknowledgements are not tied to a connection.
    fn live(&self) -> bool {
        true
    }

    /// Hands the message back undelivered (lazaret could not record what
    /// happened to it): the broker redelivers it later.
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), BrokerError>>;

    /// For a broker that [`Broker::holds_retries`]: keeps the message from
    /// redelivery for `wait` without acknowledging it (SQS
    /// `ChangeMessageVisibility`), as long as the broker allows; the runtime
    /// holds it again when it comes back early. Others hand it back.
    fn hold(self: Box<Self>, wait: Duration) -> BoxFuture<'static, Result<(), BrokerError>> {
        let _ = wait;
        self.release()
    }
}

/// A stream of messages from one queue.
pub trait Consumer: Send {
    /// The next message; `Ok(None)` when the broker closed the consumer.
    /// Called only when the runtime can start delivering it, so a broker
    /// that buffers ahead should be asked for no more than it was.
    fn next(&mut self) -> BoxFuture<'_, Result<Option<Incoming>, BrokerError>>;
}

/// One broker, as a source's runtime and its redrive use it.
pub trait Broker: Send + Sync + fmt::Debug {
    /// `rabbitmq`, `nats`, `redis`.
    fn kind(&self) -> &'static str;

    /// Opens a consumer on the source's queue (its consumer group, durable
    /// consumer, prefetch of `SourceSpec::unsettled_max`). Called again
    /// after an error.
    fn consume(&self) -> BoxFuture<'_, Result<Box<dyn Consumer>, BrokerError>>;

    /// Publishes and returns once the broker confirmed it (publisher
    /// confirms with `mandatory`; a JetStream PubAck; `XADD`'s reply).
    fn publish(&self, msg: Republish) -> BoxFuture<'_, Result<(), BrokerError>>;

    /// Whether a retry or deferral waits on the broker instead of in
    /// lazaret's store: an SQS FIFO message that failed must keep holding
    /// its message group, so it is held ([`Acker::hold`]), not
    /// acknowledged, and its redelivery is the retry. The store then only
    /// records what lazaret charged (`hold_retry`, never delivered from).
    fn holds_retries(&self) -> bool {
        false
    }

    /// Whether a message at `position` (its [`Delivery::position`]) that
    /// lazaret acknowledged may still come from the broker again: a Kafka
    /// record until the group's committed offset passed it (a record before
    /// it still unsettled). A held retry of such a message that then
    /// finishes is not forgotten but kept in the store as a trace until
    /// this turns `false`, so the record read again after a crash is
    /// recognised and acknowledged instead of delivered from attempt 1
    /// after its later attempts. `false` by default: an acknowledged
    /// message is gone.
    fn may_come_again(
        &self,
        position: &serde_json::Value,
    ) -> BoxFuture<'_, Result<bool, BrokerError>> {
        let _ = position;
        Box::pin(async { Ok(false) })
    }

    /// Limits the broker enforces itself that could dead-letter a message
    /// before the policy would (quorum `x-delivery-limit`, `MaxDeliver`),
    /// as warnings for the log; `attempts_max` is the policy's.
    fn check_limits(&self, attempts_max: u32) -> BoxFuture<'_, Vec<String>> {
        let _ = attempts_max;
        Box::pin(async { Vec::new() })
    }

    /// Closes the broker's connections, at shutdown, once the source has
    /// stopped: while the runtime still runs, so a client whose I/O runs on
    /// it (lapin) is not torn down mid-connection (RabbitMQ logged an ERROR
    /// at every clean shutdown). A no-op where dropping is enough.
    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    /// Watch mode: what a message of the broker's dead-letter queue says of
    /// itself (reason, error text, original queue and coordinates, delivery
    /// count). The default knows nothing of it (`unknown_origin`).
    fn interpret<'a>(&'a self, d: &'a Delivery) -> BoxFuture<'a, Result<TakenIn, BrokerError>> {
        let _ = d;
        Box::pin(async { Ok(TakenIn::default()) })
    }
}

/// A broker's messages, reconnecting after errors: what guard and watch
/// sources share.
pub(crate) struct Reconnecting<'a> {
    broker: &'a dyn Broker,
    source: &'a str,
    consumer: Option<Box<dyn Consumer>>,
    failures: u32,
}

impl<'a> Reconnecting<'a> {
    pub(crate) fn new(broker: &'a dyn Broker, source: &'a str) -> Self {
        Reconnecting {
            broker,
            source,
            consumer: None,
            failures: 0,
        }
    }

    /// The next message; `None` once `shutdown` turns true. Opens the
    /// consumer when there is none, and after an error waits
    /// [`reconnect_delay`] before opening it again.
    pub(crate) async fn next(
        &mut self,
        shutdown: &mut tokio::sync::watch::Receiver<bool>,
    ) -> Option<Incoming> {
        loop {
            if *shutdown.borrow() {
                return None;
            }
            let consumer = match &mut self.consumer {
                Some(c) => c,
                None => match self.broker.consume().await {
                    Ok(c) => self.consumer.insert(c),
                    Err(e) => {
                        self.failed(&e.to_string(), shutdown).await?;
                        continue;
                    }
                },
            };
            let next = tokio::select! {
                n = consumer.next() => n,
                _ = shutdown.changed() => return None,
            };
            match next {
                Ok(Some(incoming)) => {
                    self.failures = 0;
                    return Some(incoming);
                }
                Ok(None) => {
                    tracing::warn!(source = %self.source, "the broker closed the consumer; reconnecting");
                    self.consumer = None;
                }
                Err(e) => {
                    self.consumer = None;
                    self.failed(&e.to_string(), shutdown).await?;
                }
            }
        }
    }

    /// Logs, then waits out the reconnect delay; `None` at shutdown.
    async fn failed(
        &mut self,
        why: &str,
        shutdown: &mut tokio::sync::watch::Receiver<bool>,
    ) -> Option<()> {
        self.failures += 1;
        tracing::warn!(source = %self.source, "{why}; reconnecting");
        tokio::select! {
            _ = tokio::time::sleep(reconnect_delay(self.failures)) => Some(()),
            _ = shutdown.changed() => None,
        }
    }
}

/// How long to wait before reconnecting after the `n`-th failure in a row.
pub fn reconnect_delay(n: u32) -> Duration {
    Duration::from_millis(100u64.saturating_mul(1 << n.min(6))).min(Duration::from_secs(5))
}
