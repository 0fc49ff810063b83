//! A source as configured (`[[sources]]` in the server's TOML file, or built
//! by a library user): which broker, which queue, what to do with it.

use std::time::Duration;

use lazaret_core::{JobType, Lane};

/// The brokers a source can name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BrokerKind {
    /// RabbitMQ (AMQP 0-9-1), Celery on it included.
    RabbitMq,
    /// NATS JetStream.
    Nats,
    /// Redis Streams.
    Redis,
    /// Kafka (a topic read by a consumer group).
    Kafka,
    /// Amazon SQS (a standard or FIFO queue).
    Sqs,
}

impl BrokerKind {
    /// Every broker a source can name, in the order the docs list them.
    pub const ALL: [BrokerKind; 5] = [
        BrokerKind::RabbitMq,
        BrokerKind::Nats,
        BrokerKind::Redis,
        BrokerKind::Kafka,
        BrokerKind::Sqs,
    ];

    /// The word used in the config and in dead letters.
    pub const fn as_str(self) -> &'static str {
        match self {
            BrokerKind::RabbitMq => "rabbitmq",
            BrokerKind::Nats => "nats",
            BrokerKind::Redis => "redis",
            BrokerKind::Kafka => "kafka",
            BrokerKind::Sqs => "sqs",
        }
    }

    /// The broker a word names.
    pub fn parse(word: &str) -> Option<BrokerKind> {
        BrokerKind::ALL.into_iter().find(|b| b.as_str() == word)
    }

    /// The URL schemes (lower case) that name this broker: none for SQS,
    /// whose endpoint is a plain `http(s)://` URL.
    pub const fn schemes(self) -> &'static [&'static str] {
        match self {
            BrokerKind::RabbitMq => &["amqp", "amqps"],
            BrokerKind::Nats => &["nats"],
            BrokerKind::Redis => &["redis", "rediss", "redis+unix"],
            BrokerKind::Kafka => &["kafka"],
            BrokerKind::Sqs => &[],
        }
    }

    /// The broker a URL's scheme names, when it names one: a `redis://` URL
    /// under `broker = "rabbitmq"` is a copy-paste slip worth refusing at
    /// start rather than a connection that fails for ever in the background.
    pub fn from_url(url: &str) -> Option<BrokerKind> {
        let (scheme, _) = url.split_once("://")?;
        let scheme = scheme.to_ascii_lowercase();
        BrokerKind::ALL
            .into_iter()
            .find(|b| b.schemes().contains(&scheme.as_str()))
    }

    /// What a source's `url` looks like for this broker, for messages.
    pub const fn url_form(self) -> &'static str {
        match self {
            BrokerKind::RabbitMq => "\"amqp://…\"",
            BrokerKind::Nats => "\"nats://…\"",
            BrokerKind::Redis => "\"redis://…\"",
            BrokerKind::Kafka => "\"host:port\" (kafka)",
            BrokerKind::Sqs => "\"http(s)://…\" (sqs)",
        }
    }

    /// Every broker's word, quoted, as a message lists them:
    /// `"rabbitmq", "nats", "redis", "kafka" or "sqs"`.
    pub fn words() -> String {
        or_list(BrokerKind::ALL.map(|b| format!("\"{}\"", b.as_str())))
    }

    /// Every broker's [`url_form`](Self::url_form), as a message lists them.
    pub fn url_forms() -> String {
        or_list(BrokerKind::ALL.map(|b| b.url_form().to_owned()))
    }
}

/// `a, b, c or d`.
fn or_list<const N: usize>(items: [String; N]) -> String {
    match items.split_last() {
        Some((last, [])) => last.clone(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    }
}

/// What a source does with its queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Consume the queue and deliver each message to the handler, with
    /// every gate applied.
    Guard,
    /// The queue is a dead-letter queue the broker fills: take each message
    /// in as a dead letter (`stage: "broker"`).
    Watch,
}

/// Where a message's tenant comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TenantFrom {
    /// Every message of the source has this tenant.
    Fixed(String),
    /// The tenant is in this message header (`default` when absent).
    Header(String),
}

/// How a guard source's message is POSTed to its handler.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeliverFormat {
    /// The body byte for byte, the message's content type as
    /// `Content-Type`, its headers in `Lazaret-Headers` (cut at 6 KiB).
    #[default]
    Raw,
    /// One JSON object: `message_id`, `source`, `attempt`, `content_type`,
    /// `headers` (whole) and `body` (UTF-8 text) or `body_base64`.
    Envelope,
}

impl DeliverFormat {
    /// The word used in the config (`deliver_format`).
    pub const fn as_str(self) -> &'static str {
        match self {
            DeliverFormat::Raw => "raw",
            DeliverFormat::Envelope => "envelope",
        }
    }

    /// The format a word names.
    pub fn parse(word: &str) -> Option<DeliverFormat> {
        match word {
            "raw" => Some(DeliverFormat::Raw),
            "envelope" => Some(DeliverFormat::Envelope),
            _ => None,
        }
    }
}

/// One source.
#[derive(Clone, Debug)]
pub struct SourceSpec {
    /// Unique; dead letters and metrics carry it.
    pub name: String,
    /// Which broker.
    pub broker: BrokerKind,
    /// How to reach it (`amqp://…`, `nats://…`, `redis://…`).
    pub url: String,
    /// RabbitMQ queue · JetStream stream · Redis stream.
    pub queue: String,
    /// JetStream durable consumer · Redis consumer group (default `lazaret`).
    pub group: String,
    /// Guard or watch.
    pub mode: Mode,
    /// Guard: the URL each message is POSTed to (`None` for a handler
    /// passed to the library).
    pub deliver: Option<String>,
    /// Guard: how each message is POSTed to `deliver`.
    pub deliver_format: DeliverFormat,
    /// The lazaret job type whose policy applies.
    pub job_type: JobType,
    /// The lane its dead letters are filed under.
    pub lane: Lane,
    /// The tenant.
    pub tenant: TenantFrom,
    /// Guard: deliveries in flight.
    pub concurrency: u32,
    /// Guard: messages whose outcome is decided and whose write and
    /// acknowledgement are under way, beyond `concurrency` (`None`, the
    /// default: [`SETTLING_PER_SLOT`] × `concurrency`). Above 0 a delivery gives its
    /// handler slot back once its outcome is decided and fed to the
    /// breakers, so a dead letter's durable write or an acknowledgement
    /// does not hold up the next delivery. 0: the slot is held until the
    /// message is settled.
    pub settling: Option<u32>,
    /// Guard: a delivery slower than this failed (kind `timeout`).
    pub delivery_timeout: Duration,
    /// Where a redrive republishes (default: the source queue, or for watch
    /// the message's original queue).
    pub redrive_to: Option<String>,
    /// Watch: the queues a redrive may go back to besides `redrive_to`
    /// (the message names its original queue, and whoever can publish to
    /// the dead-letter queue controls that). The server puts the queues of
    /// the config's own sources on the same broker here, and the
    /// `redrive_allow` list; empty: only `redrive_to`. Never the watched
    /// queue itself.
    pub redrive_allow: Vec<String>,
    /// Guard, SQS: `ReceiveMessage` calls in flight at once (at least 1;
    /// default [`RECEIVES_IN_FLIGHT`]), so one slow receive does not idle
    /// the handlers. A FIFO queue is always read by one receive at a time.
    pub receives_in_flight: u32,
}

/// SQS receives in flight per source by default.
pub const RECEIVES_IN_FLIGHT: u32 = 2;

/// Settling slots per handler slot by default, so that RabbitMQ's prefetch
/// is 16 × `concurrency` (256 at the default 16, inside the 100–300 that
/// RabbitMQ advises for throughput). In a poison storm the acks of the
/// messages after a dead letter wait for its durable write, so they can go
/// as one frame with it (`rabbitmq`), and dead letters wait a few
/// milliseconds for each other to share that write (`guard`): the window
/// must hold a few milliseconds of deliveries beyond the handlers', or the
/// consumer stalls on a full prefetch. At 30,000 msg/s, 7 per slot
/// (prefetch 128) held too few: a 10% poison mix lowered the healthy rate
/// to 0.87 of the clean one; 15 gave 1.04 (`docs/benchmarks.md`).
pub const SETTLING_PER_SLOT: u32 = 15;

impl SourceSpec {
    /// Guard: messages being settled beyond `concurrency`
    /// ([`SourceSpec::settling`]; by default [`SETTLING_PER_SLOT`] per
    /// handler slot).
    pub fn settling_max(&self) -> u32 {
        self.settling
            .unwrap_or(self.concurrency.max(1).saturating_mul(SETTLING_PER_SLOT))
    }

    /// Guard: messages taken from the broker and not settled yet, at most
    /// (RabbitMQ's prefetch): `concurrency` with their handler running, and
    /// [`SourceSpec::settling_max`] more whose outcome is decided and whose
    /// write and acknowledgement are under way.
    pub fn unsettled_max(&self) -> u32 {
        self.concurrency.max(1).saturating_add(self.settling_max())
    }

    /// A guard source with the contract's defaults, for library users and
    /// tests: group `lazaret`, tenant `default`, lane `default`, 16 in
    /// flight (and 15 × as many settling), 30 s per delivery.
    pub fn guard(
        name: impl Into<String>,
        broker: BrokerKind,
        url: impl Into<String>,
        queue: impl Into<String>,
        job_type: impl Into<String>,
    ) -> SourceSpec {
        SourceSpec {
            name: name.into(),
            broker,
            url: url.into(),
            queue: queue.into(),
            group: "lazaret".into(),
            mode: Mode::Guard,
            deliver: None,
            deliver_format: DeliverFormat::Raw,
            job_type: JobType::from(job_type.into().as_str()),
            lane: Lane::from("default"),
            tenant: TenantFrom::Fixed("default".into()),
            concurrency: 16,
            settling: None,
            delivery_timeout: Duration::from_secs(30),
            redrive_to: None,
            redrive_allow: Vec::new(),
            receives_in_flight: RECEIVES_IN_FLIGHT,
        }
    }

    /// A watch source with the same defaults.
    pub fn watch(
        name: impl Into<String>,
        broker: BrokerKind,
        url: impl Into<String>,
        queue: impl Into<String>,
        job_type: impl Into<String>,
    ) -> SourceSpec {
        SourceSpec {
            mode: Mode::Watch,
            ..SourceSpec::guard(name, broker, url, queue, job_type)
        }
    }

    /// The worker id recorded in attempt histories.
    pub fn worker_id(&self) -> String {
        format!("source:{}", self.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_broker_is_listed_parsed_and_known_by_its_url_schemes() {
        assert_eq!(
            BrokerKind::words(),
            r#""rabbitmq", "nats", "redis", "kafka" or "sqs""#
        );
        assert_eq!(
            BrokerKind::url_forms(),
            r#""amqp://…", "nats://…", "redis://…", "host:port" (kafka) or "http(s)://…" (sqs)"#
        );
        for b in BrokerKind::ALL {
            assert_eq!(BrokerKind::parse(b.as_str()), Some(b));
            for scheme in b.schemes() {
                assert_eq!(BrokerKind::from_url(&format!("{scheme}://h/x")), Some(b));
            }
        }
        assert_eq!(
            BrokerKind::from_url("AMQPS://h"),
            Some(BrokerKind::RabbitMq)
        );
        assert_eq!(BrokerKind::from_url("http://localhost:4566"), None);
        assert_eq!(BrokerKind::from_url("127.0.0.1:9092"), None);
        assert_eq!(BrokerKind::parse("RabbitMQ"), None);
    }
}
