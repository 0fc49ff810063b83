//! lazaret in front of the brokers teams already run.
//!
//! A *source* is a queue on RabbitMQ, NATS JetStream, Redis Streams, a
//! Kafka topic or an SQS queue.
//! In **guard** mode ([`Guard`]) lazaret consumes it and delivers each
//! message to the team's handler (an HTTP endpoint, [`HttpHandler`], or a
//! Rust closure, [`handler_fn`]), with every gate of lazaret's own jobs:
//! the attempt counted on the message (the `x-lazaret-attempt` header,
//! with the broker's delivery count as floor), failures classified and
//! decided by `lazaret-core`, retries held in lazaret's store without
//! holding the line, breakers and pauses, and quarantine before the
//! acknowledgement. In **watch** mode ([`Watch`]) the queue is a
//! dead-letter queue the broker already fills (RabbitMQ `x-death`, Celery
//! tasks on it, a Redis or JetStream stream of dead messages, a Spring Kafka
//! dead-letter topic): each message
//! becomes a readable lazaret dead letter. [`SourceSet::redrive`] sends a
//! dead letter back to its broker.
//!
//! One adapter module per broker, each behind a cargo feature (`rabbitmq`,
//! `nats`, `redis`, `kafka`, `sqs`; all on by default), implements [`Broker`]: consume,
//! acknowledge, keep a running message from redelivery, publish with
//! confirmation. Adapters only move messages; the gates are shared.
//!
//! What it deliberately does not do: decide (that is `lazaret-core`), keep
//! state of its own (that is the `Store`), or parse configuration files
//! (the server builds a [`SourceSpec`]).

pub mod adapters;
pub mod broker;
pub mod celery;
pub mod failpoint;
pub mod guard;
pub mod handler;
pub mod host;
pub mod message;
mod quarantines;
pub mod redrive;
pub mod spec;
pub mod trace;
pub mod watch;

#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(feature = "sqs")]
pub mod sqs;

pub use adapters::connect;
pub use broker::{Acker, Broker, BrokerError, Consumer, Incoming};
pub use guard::{Faults, Guard, GuardError, Settled};
pub use handler::{Call, Handler, HttpHandler, Outcome, OwnedCall, handler_fn};
pub use host::{Host, LocalHost, StoreWrites};
pub use message::{Delivery, Republish, TakenIn};
pub use quarantines::QUARANTINE_LINGER;
pub use redrive::{REDRIVE_ID_HEADER, RedriveError, SourceSet};
pub use spec::{BrokerKind, DeliverFormat, Mode, SourceSpec, TenantFrom};
pub use watch::Watch;
